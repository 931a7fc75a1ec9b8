"""How much does packing save on a dataset? Forecast lengths from headers, pack, compare with padding.

The analysis behind ``vlm-pack analyze`` (and the notebook), in four steps::

    sources ----------> SampleInfo --------------> LengthTable ---------------> Report ------> table / JSON / PNG
    (.tar shards,       key, conversation,         per sample: text tokens,     per capacity:
     JSONL manifest)    image (width, height)      vision tokens, images,       padded baseline vs packed,
                        from headers only          where each image sits        grad-accum equivalent
       scan_samples()                 forecast_lengths()          analyze()        format_report() / write_report()

Lengths are *expanded* lengths, the positions a sample occupies in the language model: its text tokens
(chat template included) plus the placeholders its images become (``vision.VisionSpec.sample_tokens``).
No pixel is decoded; the forecast equals ``len(process_sample(...)["input_ids"])``.

The padded baseline is what a plain ``DataLoader`` does: micro-batches of ``batch_size`` samples, each
padded to its longest sample, in random order and length-grouped (Hugging Face ``group_by_length``:
mega-batches of ``50 * batch_size`` sorted by length)::

    padded, B = 3                                 packed, capacity C
    |s0 ......|###########|   waste = #           |s0 ......|s4 ..|s7 ....|s2 .|##|   waste = 1 - efficiency
    |s1 .................|                        |s1 .................|s3 ....|#|
    |s2 ..|###############|

Packing changes how many samples one micro step sees, so to keep the optimizer's samples per update close
to the padded run (seed 003 of the project)::

    grad_accum_packed = ceil(target_samples_per_update / (mean_samples_per_pack * world_size * packs_per_device))

with ``target_samples_per_update = batch_size * world_size * grad_accum`` of the padded run by default.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlm_pack._version import __version__
from vlm_pack.config import PackingConfig
from vlm_pack.packing import PackResult, pack

__all__ = [
    "Baseline",
    "LengthTable",
    "SampleInfo",
    "SampleReadError",
    "analyze",
    "analyze_capacity",
    "expand_sources",
    "forecast_lengths",
    "format_report",
    "padded_batches",
    "plot_efficiency",
    "plot_lengths",
    "plot_packs",
    "scan_samples",
    "write_report",
]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_JSONL_SUFFIXES = (".jsonl", ".json")


# ------------------------------------------------------------------------------------------------------
# Reading: sources -> SampleInfo (headers only)
# ------------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------------
# Forecast: SampleInfo -> LengthTable
# ------------------------------------------------------------------------------------------------------


@dataclass
class LengthTable:
    """Per-sample forecast, as flat arrays (ragged per-image data in CSR form).

    Attributes:
        keys, sources: ``[N]`` sample keys and where they were read.
        text_tokens: int64 ``[N]``: tokens that are not image placeholders (template and wrappers included).
        vision_tokens: int64 ``[N]``: image placeholder tokens (sum over the sample's images).
        num_patches: int64 ``[N]``: vision-encoder patches (the ViT's second budget).
        image_ptr: int64 ``[N + 1]``: images of sample ``i`` are ``image_ptr[i]:image_ptr[i+1]``.
        image_tokens: int64 ``[M]``: placeholders of each image.
        image_starts: int64 ``[M]``: offset of each image's first placeholder inside its (expanded) sample.
        invalid: ``(key, source, reason)`` of samples that could not be forecast (``on_error="skip"``).
    """

    keys: list[str]
    sources: list[str]
    text_tokens: np.ndarray
    vision_tokens: np.ndarray
    num_patches: np.ndarray
    image_ptr: np.ndarray
    image_tokens: np.ndarray
    image_starts: np.ndarray
    invalid: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[N]``: expanded lengths (text + vision tokens)."""
        return self.text_tokens + self.vision_tokens

    @property
    def num_images(self) -> np.ndarray:
        """int64 ``[N]``: images per sample."""
        return np.diff(self.image_ptr)

    def __len__(self) -> int:
        return len(self.keys)


def forecast_lengths(
    samples: Iterable[SampleInfo],
    *,
    tokenizer: Any,
    spec: Any,
    family: str | None = None,
    on_error: str = "raise",
    progress: bool | None = None,
) -> LengthTable:
    """Tokenize each conversation and forecast its images' placeholders: a :class:`LengthTable`.

    ``spec`` is a ``vlm_pack.vision`` spec; ``family`` picks the chat format (default: the tokenizer's
    ``vlm_pack_family``, else the spec's family). ``on_error="skip"`` records bad samples in
    ``LengthTable.invalid`` instead of raising. ``progress`` shows a tqdm bar (``None``: only on a terminal).
    """
    from tqdm import tqdm

    from vlm_pack.processing import _image_token_id, tokenize_conversation

    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    family = family or getattr(tokenizer, "vlm_pack_family", None) or spec.family
    image_id = _image_token_id(tokenizer, family)
    keys: list[str] = []
    sources: list[str] = []
    text: list[int] = []
    patches: list[int] = []
    counts: list[int] = []
    starts: list[int] = []
    ptr = [0]
    invalid: list[tuple[str, str, str]] = []
    bar = tqdm(
        samples, desc="forecast", unit=" samples", disable=(not progress) if progress is not None else None
    )
    for s in bar:
        if s.error is not None:
            if on_error == "raise":
                raise SampleReadError(s.error)
            invalid.append((s.key, s.source, s.error))
            continue
        try:
            ids, _ = tokenize_conversation(
                s.conversation, tokenizer=tokenizer, family=family, num_images=len(s.image_sizes), key=s.key
            )
            n = [int(t) for t in spec.sample_tokens(list(s.image_sizes))] if s.image_sizes else []
            p = sum(int(spec.num_patches(w, h)) for w, h in s.image_sizes)
        except (ValueError, TypeError) as e:
            if on_error == "raise":
                msg = str(e) if s.key in str(e) else f"sample {s.key!r}: {e}"
                raise SampleReadError(f"{s.source}: {msg}") from None
            invalid.append((s.key, s.source, str(e)))
            continue
        # Collapsed placeholder positions -> expanded starts: shift by the earlier images' extra tokens.
        pos = np.flatnonzero(np.asarray(ids) == image_id)
        if n:
            extra = np.concatenate([[0], np.cumsum(np.asarray(n) - 1)[:-1]])
            starts.extend((pos + extra).tolist())
        counts.extend(n)
        keys.append(s.key)
        sources.append(s.source)
        text.append(len(ids) - len(n))
        patches.append(p)
        ptr.append(len(counts))
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    ptr_a, counts_a = i64(ptr), i64(counts)
    csum = np.concatenate([[0], np.cumsum(counts_a)])
    vision = csum[ptr_a[1:]] - csum[ptr_a[:-1]]  # per-sample sums; samples without images get 0
    return LengthTable(
        keys, sources, i64(text), vision.astype(np.int64), i64(patches), ptr_a, counts_a, i64(starts), invalid
    )


# ------------------------------------------------------------------------------------------------------
# Analysis: LengthTable -> Report
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """The padded run to compare with, and how packed micro-batches are laid out.

    ``target_samples_per_update`` defaults to ``batch_size * world_size * grad_accum``.
    """

    batch_size: int = 4
    world_size: int = 1
    grad_accum: int = 4
    packs_per_device: int = 1
    target_samples_per_update: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "world_size", "grad_accum", "packs_per_device"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        t = self.target_samples_per_update
        if t is not None and (not isinstance(t, int) or t < 1):
            raise ValueError(f"target_samples_per_update must be a positive integer, got {t!r}")

    @property
    def samples_per_update(self) -> int:
        if self.target_samples_per_update is not None:
            return self.target_samples_per_update
        return self.batch_size * self.world_size * self.grad_accum


def padded_batches(
    lengths: np.ndarray, batch_size: int, *, order: str = "random", seed: int = 0
) -> dict[str, Any]:
    """Padding cost of micro-batches of ``batch_size`` samples, each padded to its longest (last one partial).

    ``order``: ``"random"`` (a shuffled epoch) or ``"grouped"`` (HF ``group_by_length``: shuffled, then
    mega-batches of ``50 * batch_size`` sorted longest first). Returns ``batches``, ``real_tokens``,
    ``padded_tokens`` (tokens computed, padding included), ``waste`` (padding share of ``padded_tokens``) and
    ``max_batch_tokens`` (the largest ``batch_size * longest``, what memory must hold).
    """
    lens = np.asarray(lengths, dtype=np.int64)
    n = lens.size
    if n == 0:
        return dict(batches=0, real_tokens=0, padded_tokens=0, waste=0.0, max_batch_tokens=0)
    perm = np.random.default_rng(seed).permutation(n)
    x = lens[perm]
    if order == "grouped":
        mega = 50 * batch_size
        pad = -n % mega
        m = np.concatenate([x, np.full(pad, -1, np.int64)]).reshape(-1, mega)
        m = -np.sort(-m, axis=1)  # longest first; -1 fillers sink to the end of the last mega-batch
        x = m.reshape(-1)[: n + pad]
        x = x[x >= 0]
    elif order != "random":
        raise ValueError(f"order must be 'random' or 'grouped', got {order!r}")
    pad = -n % batch_size
    rows = np.concatenate([x, np.zeros(pad, np.int64)]).reshape(-1, batch_size)
    count = np.full(rows.shape[0], batch_size, np.int64)
    count[-1] = batch_size - pad
    padded = rows.max(axis=1) * count
    real, total = int(lens.sum()), int(padded.sum())
    return dict(
        batches=int(rows.shape[0]),
        real_tokens=real,
        padded_tokens=total,
        waste=1.0 - real / total,
        max_batch_tokens=int(rows.max(axis=1).max() * batch_size),
    )


def _stats(a: np.ndarray) -> dict[str, float]:
    if a.size == 0:
        return dict(mean=0.0, p50=0.0, p95=0.0, max=0.0, min=0.0)
    p50, p95 = np.percentile(a, [50, 95])
    return dict(mean=float(a.mean()), p50=float(p50), p95=float(p95), max=float(a.max()), min=float(a.min()))


def _grad_accum(target: int, per_micro: float) -> tuple[int, int]:
    """``(recommended, smallest reaching target)`` grad-accum steps for ``per_micro`` samples per micro step.

    Recommended: the one whose samples per update are closest to ``target`` (a tie goes to the larger, which
    does not undershoot). ``13`` samples per micro step, target ``16``: recommended 1 (13 samples), smallest
    reaching the target 2 (26 samples).
    """
    if per_micro <= 0:
        return 0, 0
    low = max(1, math.floor(target / per_micro))
    high = max(1, math.ceil(target / per_micro))
    closest = low if abs(low * per_micro - target) < abs(high * per_micro - target) else high
    return closest, high


def _pack_table(table: LengthTable, config: PackingConfig, strategy: str) -> PackResult:
    """:func:`vlm_pack.packing.pack` with ``config``'s knobs, its vision budget counted as ``config.vision_cost``."""
    vision = None
    if config.vision_capacity is not None:
        vision = table.num_images if config.vision_cost == "images" else table.num_patches
    return pack(
        table.lengths,
        config.capacity,
        strategy=strategy,
        vision=vision,
        vision_capacity=config.vision_capacity,
        max_samples_per_bin=config.max_samples_per_bin,
        oversized=config.oversized,
    )


def _analysis_config(
    capacity: int,
    config: PackingConfig | None,
    oversized: str,
    max_samples_per_pack: int | None,
    max_images_per_pack: int | None,
    max_patches_per_pack: int | None,
) -> PackingConfig:
    if config is not None:
        config = config.replace(capacity=int(capacity))
    else:
        if max_images_per_pack is not None and max_patches_per_pack is not None:
            raise ValueError("give at most one of max_images_per_pack and max_patches_per_pack")
        images = max_images_per_pack is not None
        config = PackingConfig(
            capacity=int(capacity),
            max_samples_per_bin=max_samples_per_pack,
            vision_capacity=max_images_per_pack if images else max_patches_per_pack,
            vision_cost="images" if images else "patches",
            oversized=oversized,
        )
    if config.oversized not in ("skip", "truncate"):
        raise ValueError(f"oversized must be 'skip' or 'truncate' for an analysis, got {config.oversized!r}")
    return config


def analyze_capacity(
    table: LengthTable,
    capacity: int,
    *,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    oversized: str = "skip",
    max_samples_per_pack: int | None = None,
    max_images_per_pack: int | None = None,
    max_patches_per_pack: int | None = None,
    seed: int = 0,
    config: PackingConfig | None = None,
) -> tuple[dict[str, Any], PackResult]:
    """Pack ``table`` at ``capacity`` and compare with the padded ``baseline``.

    ``config`` (a :class:`vlm_pack.config.PackingConfig`; its ``capacity`` is replaced by ``capacity``) gives
    the packing knobs; without it they come from ``oversized`` and the ``max_*_per_pack`` arguments.
    Samples longer than ``capacity`` are skipped (``oversized="skip"``) or counted at ``capacity``
    (``"truncate"``, as a padded run with ``max_length=capacity`` would cut them); both are reported.
    The padded baseline is the same at every capacity: a padded run has no capacity, so it batches every
    sample of ``table`` at its full length, in one fixed random order (``seed``).
    Returns ``(metrics, PackResult)``.
    """
    config = _analysis_config(
        capacity, config, oversized, max_samples_per_pack, max_images_per_pack, max_patches_per_pack
    )
    capacity = config.capacity
    lengths = table.lengths
    if lengths.size and lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"sample {table.keys[i]!r} has length 0: nothing to train on; drop it.")
    result = _pack_table(table, config, strategy)
    kept = result.order
    kept_lens = result.lengths[kept]
    sizes = result.bin_sizes
    b = baseline
    padded = {
        order: padded_batches(lengths, b.batch_size, order=order, seed=seed) for order in ("random", "grouped")
    }
    n, nb = int(kept.size), result.num_bins
    mean_spp = n / nb if nb else 0.0
    target = b.samples_per_update
    per_micro = mean_spp * b.world_size * b.packs_per_device
    ga_best, ga_reach = _grad_accum(target, per_micro)
    micro_padded = math.ceil(lengths.size / (b.batch_size * b.world_size))
    micro_packed = math.ceil(nb / (b.world_size * b.packs_per_device))
    seg = lambda v: np.add.reduceat(v[kept], result.bin_offsets[:-1]) if nb else np.zeros(0, np.int64)  # noqa: E731
    vision_kept = np.minimum(table.vision_tokens, result.lengths)  # a truncated sample keeps <= capacity
    metrics: dict[str, Any] = {
        "capacity": int(capacity),
        "samples": int(table.lengths.size),
        "packed_samples": n,
        "oversized_skipped": [
            {"key": table.keys[u.index], "source": table.sources[u.index], "reason": u.reason}
            for u in result.unpacked
        ],
        "truncated": [
            {"key": table.keys[i], "source": table.sources[i], "length": int(L)}
            for i, L in result.truncated.items()
        ],
        "text_tokens": int(np.minimum(table.text_tokens[kept], kept_lens).sum()),
        "vision_tokens": int(vision_kept[kept].sum()),
        "tokens": int(kept_lens.sum()),
        "padded": {
            order: {**v, "micro_steps_per_epoch": micro_padded, "batch_size": b.batch_size}
            for order, v in padded.items()
        },
        "packed": {
            "strategy": strategy,
            "bins": nb,
            "lower_bound": result.lower_bound,
            "efficiency": result.efficiency,
            "waste": 1.0 - result.efficiency if nb else 0.0,
            "padded_tokens": nb * int(capacity),
            "samples_per_pack": _stats(sizes.astype(np.float64)),
            "images_per_pack": _stats(seg(table.num_images).astype(np.float64)),
            "vision_tokens_per_pack": _stats(seg(vision_kept).astype(np.float64)),
            "micro_steps_per_epoch": micro_packed,
        },
        "grad_accum": {
            "target_samples_per_update": target,
            "padded": {
                "batch_size": b.batch_size,
                "world_size": b.world_size,
                "grad_accum": b.grad_accum,
                "samples_per_update": b.batch_size * b.world_size * b.grad_accum,
                "optimizer_steps_per_epoch": math.ceil(micro_padded / b.grad_accum),
            },
            "packed": {
                "packs_per_device": b.packs_per_device,
                "world_size": b.world_size,
                "grad_accum": ga_best,  # samples per update closest to the target
                "samples_per_update": per_micro * ga_best,
                "optimizer_steps_per_epoch": math.ceil(micro_packed / ga_best) if ga_best else 0,
                "min_grad_accum_reaching_target": ga_reach,  # never fewer samples per update than the target
                "min_reaching_samples_per_update": per_micro * ga_reach,
            },
        },
    }
    return metrics, result


def analyze(
    table: LengthTable,
    capacities: Sequence[int],
    *,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    oversized: str = "skip",
    max_samples_per_pack: int | None = None,
    max_images_per_pack: int | None = None,
    max_patches_per_pack: int | None = None,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
    config: PackingConfig | None = None,
) -> tuple[dict[str, Any], list[PackResult]]:
    """:func:`analyze_capacity` for each capacity, plus dataset statistics: ``(report, pack results)``.

    ``config``: the packing knobs as one :class:`vlm_pack.config.PackingConfig` (its capacity is replaced by
    each of ``capacities``), instead of ``oversized`` and the ``max_*_per_pack`` arguments.
    """
    if not capacities:
        raise ValueError("give at least one capacity")
    if len(table) == 0:
        raise ValueError("no samples to analyze: the sources are empty (or every sample was invalid)")
    per_cap, results = [], []
    for cap in capacities:
        m, r = analyze_capacity(
            table,
            int(cap),
            baseline=baseline,
            strategy=strategy,
            oversized=oversized,
            max_samples_per_pack=max_samples_per_pack,
            max_images_per_pack=max_images_per_pack,
            max_patches_per_pack=max_patches_per_pack,
            seed=seed,
            config=config,
        )
        per_cap.append(m)
        results.append(r)
    n_img = table.num_images
    report = {
        "vlm_pack_version": __version__,
        **(meta or {}),
        "baseline": asdict(baseline) | {"samples_per_update": baseline.samples_per_update},
        "dataset": {
            "samples": len(table),
            "images": int(n_img.sum()),
            "text_only_samples": int((n_img == 0).sum()),
            "images_per_sample": {str(k): int(v) for k, v in zip(*np.unique(n_img, return_counts=True))},
            "text_tokens": int(table.text_tokens.sum()),
            "vision_tokens": int(table.vision_tokens.sum()),
            "text_tokens_per_sample": _stats(table.text_tokens.astype(np.float64)),
            "vision_tokens_per_sample": _stats(table.vision_tokens.astype(np.float64)),
            "length_per_sample": _stats(table.lengths.astype(np.float64)),
            "invalid": [{"key": k, "source": s, "reason": r} for k, s, r in table.invalid],
        },
        "capacities": per_cap,
    }
    return report, results


# ------------------------------------------------------------------------------------------------------
# Output: table, JSON, plots
# ------------------------------------------------------------------------------------------------------


def _n(x: float) -> str:
    # Exact below 100k (capacities, per-pack counts stay comparable digit for digit), k / M / G above.
    x = float(x)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e5)):
        if abs(x) >= scale:
            scale = 1e3 if unit == "k" else scale
            return f"{x / scale:.1f}{unit}"
    return f"{x:,.0f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table: one column per capacity."""
    d, b, caps = report["dataset"], report["baseline"], report["capacities"]
    t, v, L = d["text_tokens_per_sample"], d["vision_tokens_per_sample"], d["length_per_sample"]
    lines = [
        f"vlm-pack analyze: {d['samples']:,} samples ({d['images']:,} images, {d['text_only_samples']:,} text-only)"
        + (f" | {report['family']}" if report.get("family") else "")
        + (f" | {report['source']}" if report.get("source") else ""),
        f"tokens per sample   text   mean {t['mean']:>7,.0f}  p50 {t['p50']:>7,.0f}  p95 {t['p95']:>7,.0f}  max {t['max']:>7,.0f}",
        f"                    vision mean {v['mean']:>7,.0f}  p50 {v['p50']:>7,.0f}  p95 {v['p95']:>7,.0f}  max {v['max']:>7,.0f}",
        f"                    total  mean {L['mean']:>7,.0f}  p50 {L['p50']:>7,.0f}  p95 {L['p95']:>7,.0f}  max {L['max']:>7,.0f}",
    ]
    if d["invalid"]:
        lines.append(f"invalid samples skipped: {len(d['invalid'])} (listed in report.json)")
    lines.append(
        f"padded baseline: {b['batch_size']} samples/device x {b['world_size']} device(s) x grad-accum "
        f"{b['grad_accum']}; target {b['samples_per_update']} samples per optimizer update"
    )
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("samples packed", lambda c: f"{c['packed_samples']:,}"),
        ("  oversized, skipped", lambda c: f"{len(c['oversized_skipped']):,}"),
        ("  truncated to capacity", lambda c: f"{len(c['truncated']):,}"),
        ("tokens text + vision", lambda c: f"{_n(c['text_tokens'])} + {_n(c['vision_tokens'])}"),
        ("PADDED (same at every capacity)", lambda c: ""),
        ("  micro-batches", lambda c: f"{c['padded']['random']['batches']:,}"),
        ("  padding waste, random order", lambda c: f"{c['padded']['random']['waste']:.1%}"),
        ("  padding waste, length-grouped", lambda c: f"{c['padded']['grouped']['waste']:.1%}"),
        ("  tokens computed (random)", lambda c: _n(c["padded"]["random"]["padded_tokens"])),
        ("  largest micro-batch, tokens", lambda c: _n(c["padded"]["random"]["max_batch_tokens"])),
        ("PACKED: packs", lambda c: f"{c['packed']['bins']:,} (>= {c['packed']['lower_bound']:,})"),
        ("  efficiency", lambda c: f"{c['packed']['efficiency']:.1%}"),
        ("  padding waste", lambda c: f"{c['packed']['waste']:.1%}"),
        ("  tokens computed", lambda c: _n(c["packed"]["padded_tokens"])),
        (
            "  largest micro-batch, tokens",
            lambda c: _n(c["capacity"] * report["baseline"]["packs_per_device"]),
        ),
        (
            "  samples/pack mean p50 p95",
            lambda c: "{mean:.2f} {p50:.0f} {p95:.0f}".format(**c["packed"]["samples_per_pack"]),
        ),
        ("  images/pack mean max", lambda c: "{mean:.2f} {max:.0f}".format(**c["packed"]["images_per_pack"])),
        (
            "  vision tokens/pack mean max",
            lambda c: "{} {}".format(
                _n(c["packed"]["vision_tokens_per_pack"]["mean"]),
                _n(c["packed"]["vision_tokens_per_pack"]["max"]),
            ),
        ),
        (
            "GRAD ACCUM packed, recommended (1)",
            lambda c: (
                f"{c['grad_accum']['packed']['grad_accum']} ({c['grad_accum']['packed']['samples_per_update']:.1f})"
            ),
        ),
        (
            "  smallest reaching target (2)",
            lambda c: (
                f"{c['grad_accum']['packed']['min_grad_accum_reaching_target']} "
                f"({c['grad_accum']['packed']['min_reaching_samples_per_update']:.1f})"
            ),
        ),
        (
            "  optimizer steps/epoch pad->pack",
            lambda c: (
                f"{c['grad_accum']['padded']['optimizer_steps_per_epoch']:,} -> "
                f"{c['grad_accum']['packed']['optimizer_steps_per_epoch']:,}"
            ),
        ),
        (
            "  micro steps/epoch pad->pack",
            lambda c: (
                f"{c['padded']['random']['micro_steps_per_epoch']:,} -> {c['packed']['micro_steps_per_epoch']:,}"
            ),
        ),
    ]
    head = ["capacity"] + [f"{c['capacity']:,}" for c in caps]
    body = [[label] + [fmt(c) for c in caps] for label, fmt in rows]
    w0 = max(len(r[0]) for r in [head, *body])
    ws = [max(len(r[i]) for r in [head, *body]) for i in range(1, len(head))]
    fmt_row = lambda r: "  ".join([r[0].ljust(w0)] + [x.rjust(w) for x, w in zip(r[1:], ws)])  # noqa: E731
    lines += ["", fmt_row(head), "-" * (w0 + sum(w + 2 for w in ws))]
    lines += [fmt_row(r) for r in body]
    target = b["samples_per_update"]
    lines += [
        "",
        f"grad-accum rows: micro steps per optimizer update (samples per update); target {target} samples.",
        f"  (1) recommended: samples per update closest to {target}.",
        f"  (2) the fewest steps that never give fewer than {target} samples per update.",
        "padded columns repeat: a padded run has no capacity (every sample at full length, one random order).",
    ]
    return "\n".join(lines)


def _pyplot() -> Any:
    # The backend is left alone (inline in notebooks); the CLI selects Agg through MPLBACKEND.
    import matplotlib.pyplot as plt

    return plt


def _finish(fig: Any, path: str | Path | None) -> Any:
    """Save ``fig`` to ``path`` and release it (a long CLI run opens many figures); else return it to show."""
    if path is not None:
        fig.savefig(path, dpi=110)
        _pyplot().close(fig)
    return fig


def plot_lengths(
    table: LengthTable, capacities: Sequence[int], path: str | os.PathLike[str] | None = None
) -> Any:
    """Histograms of text vs vision tokens per sample, and of total length against the capacities."""
    plt = _pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
    text, vision, total = table.text_tokens, table.vision_tokens, table.lengths
    top = max(1, int(max(text.max(initial=1), vision.max(initial=1))))
    bins = np.linspace(0, top * 1.02, 41)
    ax0.hist(text, bins=bins, alpha=0.6, label=f"text tokens (mean {text.mean():,.0f})", color="tab:blue")
    has_img = table.num_images > 0
    ax0.hist(
        vision[has_img],
        bins=bins,
        alpha=0.6,
        label=f"vision tokens, samples with images (mean {vision[has_img].mean() if has_img.any() else 0:,.0f})",
        color="tab:orange",
    )
    ax0.set(xlabel="tokens per sample", ylabel="samples", title="Text vs vision tokens per sample")
    ax0.legend(fontsize=8)
    edge = max(int(total.max(initial=1)), *capacities) * 1.05
    ax1.hist(total, bins=np.linspace(0, edge, 51), color="tab:green", alpha=0.8)
    for i, cap in enumerate(capacities):
        over = int((total > cap).sum())
        ax1.axvline(cap, color=f"C{3 + i}", ls="--", label=f"capacity {cap:,}: {over} longer")
    ax1.set(
        xlabel="expanded length (text + vision tokens)", ylabel="samples", title="Sample length vs capacity"
    )
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return _finish(fig, path)


def plot_efficiency(
    table: LengthTable,
    capacities: Sequence[int],
    *,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    path: str | os.PathLike[str] | None = None,
    points: int = 12,
    config: PackingConfig | None = None,
) -> Any:
    """Useful-token share vs capacity: packed, padded (random / length-grouped); samples per pack on the right.

    The requested ``capacities`` are marked; the curve sweeps ``points`` capacities between the median
    sample length (at least 256) and twice the largest requested one.
    """
    plt = _pyplot()
    lo = max(256, int(np.percentile(table.lengths, 50)))
    hi = max(max(capacities) * 2, lo * 2)
    sweep = sorted(set(np.geomspace(lo, hi, points).astype(int).tolist()) | {int(c) for c in capacities})
    # The padded lines are flat by construction: a padded run has no capacity (see analyze_capacity).
    rows = [analyze_capacity(table, c, baseline=baseline, strategy=strategy, config=config)[0] for c in sweep]
    eff = [r["packed"]["efficiency"] for r in rows]
    rnd = [1 - r["padded"]["random"]["waste"] for r in rows]
    grp = [1 - r["padded"]["grouped"]["waste"] for r in rows]
    spp = [r["packed"]["samples_per_pack"]["mean"] for r in rows]
    kept = [r["packed_samples"] / r["samples"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(sweep, eff, "o-", color="tab:green", label=f"packed ({strategy})")
    ax.plot(sweep, grp, "s--", color="tab:purple", label=f"padded, length-grouped (B={baseline.batch_size})")
    ax.plot(sweep, rnd, "^--", color="tab:red", label=f"padded, random order (B={baseline.batch_size})")
    ax.plot(sweep, kept, ":", color="gray", label="share of samples that fit")
    for c in capacities:
        ax.axvline(c, color="lightgray", lw=0.8, zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({sweep[0], sweep[-1], *capacities}))
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v / 1024:.3g}k"))
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set(xlabel="capacity (tokens per pack)", ylabel="useful tokens / computed tokens", ylim=(0, 1.05))
    ax.set_title("Efficiency vs capacity (requested capacities marked)")
    ax2 = ax.twinx()
    ax2.plot(sweep, spp, "d-", color="tab:blue", alpha=0.5, label="samples per pack (right)")
    ax2.set_ylabel("mean samples per pack", color="tab:blue")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    fig.tight_layout()
    return _finish(fig, path)


def plot_packs(
    table: LengthTable,
    results: PackResult | Sequence[PackResult],
    *,
    num_packs: int = 8,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """A few packs per capacity as bars: each sample a coloured segment, its image tokens hatched, padding grey.

    ``results``: one :class:`PackResult` or one per capacity (one panel each, results without packs left
    out). Packs are taken evenly over the bin order (the first bins of a decreasing strategy hold the longest
    samples, the last ones the leftovers).
    """
    from matplotlib.patches import Patch

    plt = _pyplot()
    drawable = [r for r in ([results] if isinstance(results, PackResult) else results) if r.num_bins]
    if not drawable:
        raise ValueError("no packs to draw: every sample was oversized")
    rows = [min(num_packs, r.num_bins) for r in drawable]
    fig, axes = plt.subplots(
        len(drawable),
        1,
        figsize=(12, sum(0.55 * n + 0.9 for n in rows) + 0.7),
        gridspec_kw={"height_ratios": [n + 1.6 for n in rows]},
        squeeze=False,
    )
    for ax, result in zip(axes[:, 0], drawable):
        _draw_packs(ax, table, result, num_packs)
    fig.legend(
        handles=[
            Patch(facecolor="tab:blue", alpha=0.45, edgecolor="black", label="text tokens of a sample"),
            Patch(facecolor="tab:blue", hatch="///", edgecolor="white", label="image tokens of that sample"),
            Patch(facecolor="0.88", edgecolor="0.6", label="padding"),
        ],
        fontsize=8,
        loc="lower center",
        ncol=3,
    )
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))
    return _finish(fig, path)


def _draw_packs(ax: Any, table: LengthTable, result: PackResult, num_packs: int) -> None:
    """``num_packs`` packs of ``result`` on ``ax``, evenly spread over the bin order."""
    nb, cap = result.num_bins, result.capacity
    picks = sorted(set(np.linspace(0, nb - 1, min(num_packs, nb)).round().astype(int).tolist()))
    cmap = _pyplot().get_cmap("tab20")
    for row, bin_index in enumerate(picks):
        y = len(picks) - 1 - row
        x = 0
        for slot, sample in enumerate(result.bin(bin_index).tolist()):
            length = int(result.lengths[sample])
            color = cmap((2 * slot) % 20)
            ax.barh(y, length, left=x, height=0.8, color=color, alpha=0.45, edgecolor="black", lw=0.6)
            for image in range(int(table.image_ptr[sample]), int(table.image_ptr[sample + 1])):
                start, count = int(table.image_starts[image]), int(table.image_tokens[image])
                start, stop = min(start, length), min(start + count, length)  # truncation may cut an image
                if stop > start:
                    ax.barh(y, stop - start, left=x + start, height=0.8, color=color, alpha=0.95, hatch="///",
                            edgecolor="white", lw=0)  # fmt: skip
            if length > cap * 0.06:
                ax.text(x + length / 2, y, _short(table.keys[sample]), ha="center", va="center", fontsize=6.5,
                        bbox=dict(facecolor="white", alpha=0.7, lw=0, pad=1))  # fmt: skip
            x += length
        if x < cap:
            ax.barh(y, cap - x, left=x, height=0.8, color="0.88", edgecolor="0.6", lw=0.6)
    labels = [
        f"pack {b}: {int(result.bin_sizes[b])} samples, {result.bin_lengths[b] / cap:.0%}" for b in picks
    ]
    ax.set_yticks(range(len(picks)))
    ax.set_yticklabels(labels[::-1], fontsize=8)
    ax.set_xlim(0, cap)
    ax.set_xlabel(f"token position in the pack (capacity {cap:,})")
    ax.set_title(
        f"capacity {cap:,}: {len(picks)} of {nb} packs; one colour per sample, image tokens hatched, padding grey",
        fontsize=10,
    )


def _short(key: str, width: int = 12) -> str:
    return key if len(key) <= width else "…" + key[-(width - 1) :]


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_report(
    out_dir: str | os.PathLike[str],
    report: dict[str, Any],
    table: LengthTable,
    results: Sequence[PackResult],
    *,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    plots: bool = True,
    config: PackingConfig | None = None,
) -> list[Path]:
    """Write ``report.json``, ``report.txt`` and (with matplotlib) ``lengths.png``, ``efficiency.png`` and
    ``packs.png`` (a few packs of every capacity that packed any sample) into ``out_dir``; return the paths.

    Raises ``ValueError`` naming ``out_dir`` when it cannot be created or written.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"report folder {str(out)!r} cannot be created: {e.strerror or e}.") from None
    written = []
    caps = [c["capacity"] for c in report["capacities"]]
    if plots:
        try:
            _pyplot()
        except ImportError:
            plots = False
            report = {**report, "plots_skipped": "matplotlib is not installed: pip install 'vlm-pack[plot]'"}
    if plots:
        plot_lengths(table, caps, out / "lengths.png")
        plot_efficiency(
            table, caps, baseline=baseline, strategy=strategy, path=out / "efficiency.png", config=config
        )
        written += [out / "lengths.png", out / "efficiency.png"]
        if any(r.num_bins for r in results):  # one panel per capacity that packed anything
            plot_packs(table, results, path=out / "packs.png")
            written.append(out / "packs.png")
        report = {**report, "plots": [p.name for p in written]}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    (out / "report.txt").write_text(format_report(report) + "\n")
    return [out / "report.json", out / "report.txt", *written]
