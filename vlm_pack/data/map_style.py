"""A map-style packed dataset over a ``datasets.Dataset``: forecast once, plan, then load packs by index.

::

    Dataset ──> forecast_sources ──> pack (bins) ──> balance_bins ──> plan ──> cache/plan-<digest>.npz
    (rows)      (headers only,       capacity,      equal bins per    rows of each bin, bins of each rank
                 num_proc workers)   vision budget  rank, by cost

    PackedMapDataset[i] ──> rows of one bin ──> process_sample (real processor) ──> PackingCollator
                                                                                    -> PackedBatch

Each item is one pack (a ``PackedBatch`` of one row): use ``DataLoader(ds, batch_size=None)``. Indexing::

    rank=r          item s is rank r's s-th pack of the epoch                  len = steps
    rank=None       item s * world_size + r is rank r's s-th pack              len = steps * world_size
                    (so a sequential sampler sharded by Accelerate / the HF Trainer
                     gives every rank exactly its balanced packs)

Every rank has the same number of packs (``balance_bins(equal_count=True)``; a bin is split in two when
the count does not divide), so ranks step in lock-step. ``config.shuffle_seed`` shuffles the order of
the packs per epoch (``set_epoch``); None keeps the plan order.

Resume: the order of an epoch is a pure function of the plan, the seed and the epoch, so the position in
it is the whole state. :class:`PackedSampler` yields ``(epoch, index)``, ``observe(batch)`` records what
was consumed, ``state_dict()`` / ``load_state_dict()`` continue at the next pack, with any number of
DataLoader workers.

The plan is cached: its file is named by a digest of the dataset fingerprint, the tokenizer, the image
processor, the chat format, the vision spec and the packing settings, and stores those parts; a file whose
parts differ from the current ones (a stale plan) is rebuilt, never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import PackingConfig
from .records import normalise_record
from .shards import SampleError
from .sources import open_sources
from .stats import BadSampleWarning

__all__ = ["PackedMapDataset", "PackedSampler", "plan_info"]

logger = logging.getLogger("vlm_pack.data")

_META = "__plan__"  # where a batch carries its plan metadata (see plan_info)
_CACHE_FORMAT = 1
# PackingConfig fields that shape the plan (the rest are streaming knobs or per-epoch order).
_PLAN_FIELDS = (
    "capacity",
    "max_samples_per_bin",
    "vision_capacity",
    "vision_cost",
    "oversized",
    "pad_to_multiple_of",
    "on_error",
    "exif_transpose",
)


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode("utf-8")).hexdigest()


def _tokenizer_id(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "class": type(tokenizer).__name__,
        "vocab": _digest(vocab),
        "chat_template": _digest(str(getattr(tokenizer, "chat_template", None))),
        "image_token": getattr(tokenizer, "image_token", None),
    }


def _callable_id(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    body = _digest(code.co_code + repr(code.co_consts).encode()) if code is not None else repr(fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}:{body[:16]}"


def plan_info(batch: Any) -> dict[str, Any] | None:
    """The plan metadata a :class:`PackedMapDataset` batch carries (None for other batches): ``epoch``,
    ``rank``, ``step``, ``index`` (the item), ``bin`` (its pack in the plan), ``rows`` (dataset rows,
    in the pack's order; a row that failed to load under ``on_error="warn"`` is missing, with a
    ``BadSampleWarning``), ``lengths`` (processed) and ``plan`` (the plan's digest)."""
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, Mapping) and _META in metadata:
        return metadata[_META]
    return None


def _split_for_ranks(bins: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Split bins (largest first) until ``world_size`` divides their number: no sample dropped or repeated."""
    missing = (-len(bins)) % world_size
    order = sorted(range(len(bins)), key=lambda b: (-len(bins[b]), b))
    splittable = [b for b in order if len(bins[b]) >= 2][:missing]
    if len(splittable) < missing:
        raise ValueError(
            f"{len(bins)} packs cannot be dealt equally to {world_size} ranks: too few samples to split "
            f"packs further (need {missing} more packs); use fewer ranks or more data."
        )
    out = list(bins)
    for b in splittable:
        half = len(bins[b]) // 2
        out[b] = bins[b][:half]
        out.append(bins[b][half:])
    return out


class PackedMapDataset(torch.utils.data.Dataset):
    """Packs of a ``datasets.Dataset``, by index (see the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` (or the folder ``save_to_disk`` wrote) in any record layout of
            ``vlm_pack.data.records``; image columns may be ``Image`` features (bytes or paths) or paths.
        config: a ``PackingConfig`` (or give ``capacity``): ``capacity``, ``max_samples_per_bin``,
            ``vision_capacity`` / ``vision_cost``, ``oversized`` ("raise" or "skip"), ``pad_to_multiple_of``,
            ``on_error`` ("warn": skip unreadable records, listed in ``skipped``; "raise"),
            ``exif_transpose``, ``shuffle_seed`` (pack order per epoch; None keeps the plan's order).
        processor / tokenizer + image_processor: the checkpoint's.
        family, template: the chat format (see ``processing.tokenize_conversation``).
        layout, image_root: see ``records.normalise_record``.
        world_size, rank: data-parallel ranks; ``rank=None`` indexes every rank's packs interleaved.
        strategy: ``vlm_pack.pack`` strategy.
        cache: a folder (plans named by digest), a ``.npz`` file (one plan, rebuilt when stale), or None
            for no cache. Default: ``$VLM_PACK_CACHE`` or ``~/.cache/vlm_pack``, plus ``/plans``.
        num_proc: processes for the forecast.
        collator_kwargs: passed to ``PackingCollator`` (``return_style`` included).
        progress: a tqdm bar over the forecast (None: only on a terminal).

    Attributes: ``skipped`` (``(key, where, reason)`` of samples left out), ``from_cache`` (the plan was
    read from the cache), ``plan_digest``, ``steps`` (packs per rank per epoch), ``num_samples``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        config: PackingConfig | None = None,
        capacity: int | None = None,
        processor: Any = None,
        tokenizer: Any = None,
        image_processor: Any = None,
        family: str | None = None,
        template: Callable[..., Any] | None = None,
        layout: str | None = None,
        image_root: str | os.PathLike[str] | None = None,
        world_size: int = 1,
        rank: int | None = None,
        strategy: str = "bfd",
        cache: str | os.PathLike[str] | bool | None = True,
        num_proc: int = 1,
        collator_kwargs: dict[str, Any] | None = None,
        progress: bool | None = None,
    ) -> None:
        from ..preprocessor import Preprocessor

        if config is None:
            if capacity is None:
                raise ValueError("PackedMapDataset needs config=PackingConfig(...) or capacity=")
            config = PackingConfig(capacity=capacity)
        elif capacity is not None and capacity != config.capacity:
            raise ValueError(f"capacity={capacity} disagrees with config.capacity={config.capacity}")
        if config.oversized == "truncate":
            raise ValueError("oversized='truncate' cuts samples; a map-style plan takes 'raise' or 'skip'")
        if processor is not None:
            tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
            image_processor = image_processor if image_processor is not None else processor.image_processor
        if tokenizer is None or image_processor is None:
            raise ValueError("PackedMapDataset needs tokenizer= and image_processor= (or processor=).")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) or None, got {rank!r}")
        (source,) = open_sources([dataset], image_root=image_root)
        if source.kind != "dataset":
            raise ValueError(
                "PackedMapDataset reads rows by index: give a datasets.Dataset or a save_to_disk folder "
                "(load parquet / JSON with datasets.load_dataset first); for streaming use PackedWebDataset."
            )
        self.dataset = source.ref
        self.config, self.world_size, self.rank, self.strategy = config, world_size, rank, strategy
        self.preprocessor = Preprocessor(tokenizer, image_processor, processor, family, template)
        self.layout, self.image_root = layout, source.image_root
        if "return_style" in (collator_kwargs or {}):
            raise ValueError(
                "items are PackedBatch (they carry the plan metadata): use trainer_collator(style) for the HF "
                "Trainer, or batch.model_inputs(style) in a training loop, instead of return_style"
            )
        self.collator_kwargs = {"pad_to_multiple_of": config.pad_to_multiple_of, **(collator_kwargs or {})}
        self.epoch = 0
        self._arrow: Any = None
        key = self._cache_key()
        self.plan_digest = _digest(json.dumps(key, sort_keys=True))[:16]
        path = _cache_path(cache, self.plan_digest)
        plan = _load_plan(path, key) if path is not None else None
        self.from_cache = plan is not None
        if plan is None:
            plan = self._build_plan(num_proc, progress)
            if path is not None:
                _save_plan(path, key, plan)
        self._rows, self._bin_ptr, self._forecast = plan["rows"], plan["bin_ptr"], plan["lengths"]
        self._rank_bins = plan["rank_bins"].reshape(world_size, -1)
        self.skipped: list[tuple[str, str, str]] = [tuple(s) for s in plan["skipped"]]
        self.steps = int(self._rank_bins.shape[1])
        self.num_samples = int(self._rows.size)
        self._collator = self._make_collator()

    # ------------------------------------------------------------------ plan
    def _cache_key(self) -> dict[str, Any]:
        from .._version import __version__

        pre = self.preprocessor
        ip = pre.image_processor
        ip_dict = ip.to_dict() if hasattr(ip, "to_dict") else vars(ip)
        return {
            "format": _CACHE_FORMAT,
            "vlm_pack": __version__,
            "dataset": {
                "fingerprint": getattr(self.dataset, "_fingerprint", None),
                "rows": len(self.dataset),
            },
            "tokenizer": _tokenizer_id(pre.tokenizer),
            "image_processor": _digest(json.dumps(ip_dict, sort_keys=True, default=str)),
            "chat": {"family": pre.family, "template": _callable_id(pre.template)},
            "spec": json.loads(json.dumps(pre.spec.to_dict(), default=str)),
            "packing": {
                **{f: getattr(self.config, f) for f in _PLAN_FIELDS},
                "strategy": self.strategy,
                "world_size": self.world_size,
                "layout": self.layout,
                "image_root": None if self.image_root is None else str(self.image_root),
            },
        }

    def _build_plan(self, num_proc: int, progress: bool | None) -> dict[str, Any]:
        from ..packing import balance_bins
        from .forecast import forecast_sources

        cfg = self.config
        table = forecast_sources(
            self.dataset,
            preprocessor=self.preprocessor,
            layout=self.layout,
            image_root=self.image_root,
            exif_transpose=cfg.exif_transpose,
            on_error="raise" if cfg.on_error == "raise" else "skip",
            num_workers=num_proc,
            progress=progress,
        )
        skipped = [list(s) for s in table.invalid]
        m = cfg.pad_to_multiple_of
        lengths = -(-table.lengths // m) * m  # packed on the padded span, as the collator lays samples out
        over = np.flatnonzero(lengths > cfg.capacity)
        if over.size and cfg.oversized == "raise":
            i = int(over[0])
            raise ValueError(
                f"{table.sources[i]} (key {table.keys[i]!r}): {int(table.lengths[i])} tokens exceed capacity "
                f"{cfg.capacity}; raise capacity or pass PackingConfig(oversized='skip')."
            )
        result = table.pack(cfg.replace(oversized="skip"), self.strategy, lengths=lengths)
        skipped += [[table.keys[u.index], table.sources[u.index], u.reason] for u in result.unpacked]
        if skipped:
            shown = "; ".join(f"{k} ({w}): {r}" for k, w, r in skipped[:3])
            warnings.warn(f"vlm-pack: {len(skipped)} sample(s) left out of the plan: {shown}", stacklevel=3)
        if result.num_bins == 0:
            raise ValueError("no sample fits the plan: every record was invalid or longer than the capacity")
        bins = _split_for_ranks([np.asarray(b, dtype=np.int64) for b in result.bins], self.world_size)
        parts = balance_bins([lengths[b].tolist() for b in bins], self.world_size, equal_count=True)
        sizes = np.asarray([len(b) for b in bins], dtype=np.int64)
        members = np.concatenate(bins)
        return {
            "rows": table.index[members],
            "lengths": table.lengths[members],
            "bin_ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "rank_bins": np.asarray(parts, dtype=np.int64).reshape(-1),
            "skipped": skipped,
        }

    # ------------------------------------------------------------------ items
    def __len__(self) -> int:
        return self.steps * (self.world_size if self.rank is None else 1)

    def set_epoch(self, epoch: int) -> None:
        """Use the pack order of ``epoch`` (items given as plain ints; ``PackedSampler`` passes its own)."""
        self.epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """int64 ``[steps]``: which of a rank's packs comes at each step of ``epoch``."""
        seed = self.config.shuffle_seed
        if seed is None:
            return np.arange(self.steps, dtype=np.int64)
        return np.random.default_rng([seed, epoch]).permutation(self.steps).astype(np.int64)

    def bin_of(self, index: int, epoch: int | None = None) -> tuple[int, int, int]:
        """``(rank, step, bin)`` of item ``index`` in ``epoch`` (default: the current one)."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack index {index} out of range for {len(self)} packs")
        rank, step = (
            (index % self.world_size, index // self.world_size) if self.rank is None else (self.rank, index)
        )
        epoch = self.epoch if epoch is None else epoch
        return rank, step, int(self._rank_bins[rank, self.order(epoch)[step]])

    def rows_of(self, bin_index: int) -> np.ndarray:
        """int64: the dataset rows of pack ``bin_index`` of the plan."""
        return self._rows[self._bin_ptr[bin_index] : self._bin_ptr[bin_index + 1]]

    def __getitem__(self, item: int | tuple[int, int]) -> Any:
        epoch, index = item if isinstance(item, tuple) else (self.epoch, item)
        rank, step, b = self.bin_of(int(index), int(epoch))
        rows = self.rows_of(b)
        forecast = self._forecast[self._bin_ptr[b] : self._bin_ptr[b + 1]]
        processed, kept = [], []
        for row, length in zip(rows.tolist(), forecast.tolist()):
            out = self._load(row, length)
            if out is not None:
                processed.append(out)
                kept.append(row)
        if not processed:
            raise ValueError(
                f"pack {b}: none of its samples {rows.tolist()} could be loaded (see the warnings)"
            )
        batch = self._collator(processed)
        info = {
            "epoch": int(epoch),
            "rank": rank,
            "step": step,
            "index": int(index),
            "bin": b,
            "rows": kept,
            "lengths": [int(p["input_ids"].shape[0]) for p in processed],
            "plan": self.plan_digest,
        }
        batch.metadata[_META] = info  # a dataclass field: survives .to(device) and pin_memory()
        return batch

    def _load(self, row: int, forecast: int) -> dict[str, Any] | None:
        """``_process``; under ``on_error="warn"`` a sample that fails to load is warned about and left out."""
        try:
            return self._process(row, forecast)
        except Exception as e:
            if self.config.on_error == "raise":
                raise
            warnings.warn(
                f"vlm-pack: dataset row {row} left out of its pack: {type(e).__name__}: {e}",
                BadSampleWarning,
                stacklevel=3,
            )
            return None

    def _process(self, row: int, forecast: int) -> dict[str, Any]:
        if self._arrow is None:  # Arrow rows: image bytes stay encoded until process_sample decodes them
            self._arrow = self.dataset.with_format("arrow")
        (record,) = self._arrow[row : row + 1].to_pylist()
        sample = normalise_record(
            record, layout=self.layout, key=str(row), where=f"dataset[{row}]", image_root=self.image_root
        )
        images = [im if not isinstance(im, str) else Path(im) for im in sample.images]
        out = self.preprocessor.process(images, sample.conversation, sample.key)
        n = int(out["input_ids"].shape[0])
        if n != forecast:
            raise SampleError(
                "decode_error",
                f"{sample.label}: processed to {n} tokens but the plan forecast {forecast}: the data or the "
                "processor changed since the plan was made, or the vision spec does not match the processor.",
            )
        out["__key__"], out["__row__"] = sample.key, row
        return out

    def _make_collator(self) -> Callable[[list[dict[str, Any]]], Any]:
        return self.preprocessor.collator(self.config.capacity, **self.collator_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrow"] = None  # reopened lazily in each DataLoader worker
        return state

    def trainer_collator(self, style: str = "sdpa") -> Callable[[Sequence[Any]], dict[str, Any]]:
        """A ``data_collator`` for the HF ``Trainer`` (``per_device_train_batch_size=1``,
        ``train_sampling_strategy="sequential"``, ``remove_unused_columns=False``): one pack ->
        ``batch.model_inputs(style)``."""
        return _ModelInputs(style)


@dataclasses.dataclass(frozen=True)
class _ModelInputs:
    style: str

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        if len(items) != 1:
            raise ValueError(
                f"each item is already a pack: use batch size 1 (per_device_train_batch_size=1), got {len(items)}"
            )
        return items[0].model_inputs(self.style)


# ---------------------------------------------------------------------- cache
def _cache_path(cache: str | os.PathLike[str] | bool | None, digest: str) -> Path | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        cache = Path(os.environ.get("VLM_PACK_CACHE", Path.home() / ".cache" / "vlm_pack")) / "plans"
    path = Path(cache)
    return path if path.suffix == ".npz" else path / f"plan-{digest}.npz"


def _load_plan(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            stored = json.loads(str(f["meta"]))
            plan = {name: f[name] for name in ("rows", "lengths", "bin_ptr", "rank_bins")}
    except (OSError, ValueError, KeyError) as e:
        logger.warning("vlm-pack: plan cache %s is unreadable (%s); rebuilding it", path, e)
        return None
    if stored.get("key") != key:
        changed = sorted(
            k for k in set(key) | set(stored.get("key", {})) if stored.get("key", {}).get(k) != key.get(k)
        )
        warnings.warn(
            f"vlm-pack: the cached plan {path} is stale ({', '.join(changed)} changed); rebuilding it",
            stacklevel=4,
        )
        return None
    plan["skipped"] = stored["skipped"]
    return plan


def _save_plan(path: Path, key: dict[str, Any], plan: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"key": key, "skipped": plan["skipped"]})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    arrays = {name: plan[name] for name in ("rows", "lengths", "bin_ptr", "rank_bins")}
    np.savez(tmp, meta=np.asarray(meta), **arrays)
    os.replace(tmp, path)  # atomic: a reader never sees half a plan


# ---------------------------------------------------------------------- sampler
class PackedSampler(torch.utils.data.Sampler):
    """The items of a :class:`PackedMapDataset` for one epoch, from where the last run stopped.

    Yields ``(epoch, index)`` (the dataset reads the epoch from it, so persistent DataLoader workers are
    fine). Call ``observe(batch)`` on every batch the training loop consumes; ``state_dict()`` then says
    where to continue and ``load_state_dict`` continues there, with any number of DataLoader workers.
    ``set_epoch(e)`` starts epoch ``e`` (as with ``DistributedSampler``); an iteration after an epoch observed
    to its end starts the next one.
    """

    def __init__(self, dataset: PackedMapDataset) -> None:
        self.dataset = dataset
        self.epoch = dataset.epoch
        self._next = 0

    def __len__(self) -> int:
        return len(self.dataset) - self._next

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._next = int(epoch), 0
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self._next >= len(self.dataset):  # the last epoch was consumed to its end
            self.set_epoch(self.epoch + 1)
        epoch = self.epoch
        for index in range(self._next, len(self.dataset)):
            yield epoch, index

    def observe(self, batch: Any) -> Any:
        """Record that ``batch`` was consumed; returns it."""
        info = plan_info(batch)
        if info is None:
            raise ValueError("observe() takes batches of a PackedMapDataset (they carry plan metadata)")
        if info["epoch"] == self.epoch:
            self._next = max(self._next, info["index"] + 1)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next": self._next, "plan": self.dataset.plan_digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("plan") != self.dataset.plan_digest:
            raise ValueError(
                f"the state was saved with plan {state.get('plan')!r} but the dataset's plan is "
                f"{self.dataset.plan_digest!r} (the data, processor or packing settings changed): the "
                "position in one plan means other packs in another."
            )
        self.epoch, self._next = int(state["epoch"]), int(state["next"])
        self.dataset.set_epoch(self.epoch)
