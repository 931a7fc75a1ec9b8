"""A map-style packed dataset over a ``datasets.Dataset``: forecast once, plan, then load packs by index.

::

    Dataset ──> forecast_sources ──> pack (bins) ──> balance_bins ──> Plan ──> cache/plan-<digest>/
    (rows)      (headers only,       capacity,      equal bins per    rows of each bin, bins of each rank
                 num_proc workers)   vision budget  rank, by cost     (vlm_pack.data.plan.build_plan)

    or  PackedMapDataset(dataset, pre, plan=PLAN_DIR, rank=r): a saved plan, checked against the parts, mapped

    PackedMapDataset[i] ──> rows of one bin ──> process_sample (real processor) ──> PackingCollator
                                                                                    -> PackedBatch

Each item is one pack (a ``PackedBatch`` of one row): use ``DataLoader(ds, batch_size=None)``. Indexing::

    rank=r          item s is rank r's s-th pack of the epoch                  len = steps
    rank=None       item s * world_size + r is rank r's s-th pack              len = steps * world_size
                    (so a sequential sampler sharded by Accelerate / the HF Trainer
                     gives every rank exactly its balanced packs)

Every rank has the same number of packs (packs made for whole steps, or best-fit bins, one split in two when
the count does not divide), so ranks step in lock-step, and the packs of one step cost about the same on every
rank (``balance=StepBalance(grad_accum=K, cost=PackCost.from_config(model.config))``, the default with
``grad_accum=1``; see ``vlm_pack.packing.steps`` and ``vlm_pack.packing.balanced``; ``balance="epoch"``
balances each rank's epoch total only). ``config.shuffle_seed``
shuffles the order of the *steps* per epoch (``set_epoch``): the ``grad_accum`` micro-batches of a step stay
together and in place on every rank, and a partial last step stays last; None keeps the plan's order (itself
shuffled across steps by ``StepBalance.seed``, never a length curriculum).

Resume: the order of an epoch is a pure function of the plan, the seed and the epoch, so the position in
it is the whole state. :class:`PackedSampler` yields ``(epoch, index)``, ``observe(batch)`` records what
was consumed, ``state_dict()`` / ``load_state_dict()`` continue at the next pack, with any number of
DataLoader workers.

The plan (:class:`~vlm_pack.data.plan.Plan`) is built by :func:`~vlm_pack.data.plan.build_plan`, or given
(``plan=``: a ``Plan`` or a saved plan folder; nothing is forecast, and a plan made with other parts is
refused naming them), or cached: its folder is named by a digest of the dataset fingerprint, the
preprocessor's :func:`fingerprint` (everything that changes a token: the vocabulary and added tokens, the
processor's and the tokenizer's settings and templates, the template the renderer actually uses - a Jinja
string by its full digest, a callable by its code, defaults, closure and globals -, the image processor's
settings, the vision spec) and the packing settings, and stores those parts; a plan whose parts differ from the current ones (a
stale plan) is rebuilt, never reused, with a warning naming the parts that changed (``chat.template``,
``image_processor.size``...). A template callable holding what cannot be fingerprinted is planned anew each
time, never cached.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import PackingConfig, collator_options
from ..failures import Failure, FailurePolicy, Guard, Skip, no_good_sample, tally
from ..packing.steps import block_order
from ..preprocessor import Preprocessor
from .fingerprint import Unfingerprintable
from .images import image_sizes
from .job import SampleJob
from .plan import (
    Plan,
    StalePlanError,
    _check_world_size,
    key_digest,
    make_plan,
    open_dataset,
    plan_key,
    shown_parts,
)
from .records import normalise_record
from .stats import BadSampleWarning

__all__ = ["PackedMapDataset", "PackedSampler", "plan_info"]

logger = logging.getLogger("vlm_pack.data")

_META = "__plan__"  # where a batch carries its plan metadata (see plan_info)


def plan_info(batch: Any) -> dict[str, Any] | None:
    """The plan metadata a :class:`PackedMapDataset` batch carries (None for other batches): ``epoch``,
    ``rank``, ``step``, ``index`` (the item), ``bin`` (its pack in the plan), ``rows`` (dataset rows,
    in the pack's order; a row that failed to load under ``on_error="skip"`` is missing, with a
    ``BadSampleWarning``), ``left_out`` (``[row, reason]`` of those rows), ``lengths`` (processed, in the
    layout's row length), ``plan`` (the plan's digest) and ``stand_in_for`` (the bin this pack stands in for
    when none of that one's samples loaded, else None: ``PackedMapDataset.__getitem__``)."""
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, Mapping) and _META in metadata:
        return metadata[_META]
    return None


def _warn_left_out(failure: Failure) -> None:
    """How a map-style dataset reports a row left out of its pack (``plan_info``'s ``left_out`` lists it)."""
    warnings.warn(
        f"vlm-pack: {failure.sample} left out of its pack: {failure.reason}: {failure.detail}",
        BadSampleWarning,
        stacklevel=5,
    )


class PackedMapDataset(torch.utils.data.Dataset):
    """Packs of a ``datasets.Dataset``, by index (see the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` (or the folder ``save_to_disk`` wrote) in any record format of
            ``vlm_pack.data.RECORD_FORMATS``; image columns may be ``Image`` features (bytes or paths) or paths.
        preprocessor: the checkpoint's :class:`~vlm_pack.Preprocessor` (tokenizer, processor, family,
            template, layout and spec, held once): what the plan is forecast with and each pack processed with.
        config: a ``PackingConfig``; each of its settings can also be a keyword (``capacity=8192``), alone (a
            config is built, with the same defaults) or over ``config``: ``capacity``,
            ``max_samples_per_bin``, ``vision_capacity`` / ``vision_cost``, ``oversized`` ("raise", default,
            or "skip"; a plan never cuts a sample, so "truncate" is refused), ``pad_to_multiple_of``,
            ``on_error`` ("skip", default: unreadable records are listed in ``skipped``; "raise"),
            ``exif_transpose``, ``shuffle_seed`` (pack order per epoch; None keeps the plan's order),
            ``max_consecutive_failures``.
        record_format, image_root: see ``records.normalise_record`` (default: detected per record).
        world_size, rank: data-parallel ranks; ``rank=None`` indexes every rank's packs interleaved.
            ``world_size`` defaults to the plan's when ``plan=`` is given, else 1.
        strategy: ``vlm_pack.pack`` strategy.
        plan: a :class:`~vlm_pack.data.Plan` or a folder ``Plan.save`` / ``vlm-pack plan`` wrote: used as
            it is, nothing forecast (``cache`` is not read); its key must be the one this dataset, these parts
            and settings would give, or a ``StalePlanError`` (a ``ValueError``) names what changed. A folder
            is memory-mapped: with ``rank=r`` only rank r's bins are read.
        cache: a folder (plans named by digest, ``plan-<digest>/``), a folder named ``*.plan`` (one plan,
            rebuilt when stale), or None for no cache. Default: ``$VLM_PACK_CACHE`` or ``~/.cache/vlm_pack``,
            plus ``/plans``.
        num_proc: processes for the forecast.
        collator_kwargs: passed to ``PackingCollator`` (not packing settings: those are keywords here).
        progress: a tqdm bar over the forecast (None: only on a terminal).
        balance: a ``vlm_pack.packing.StepBalance`` (default ``StepBalance()``: one pack per rank per step,
            ``PackCost()``) or ``"epoch"``; part of the plan's key. Give the training's gradient accumulation
            (``StepBalance(grad_accum=K)``) and iterate in order (``PackedSampler``, or a sequential sampler).

    Attributes: ``plan`` (the :class:`~vlm_pack.data.Plan`), ``skipped`` (``(key, where, reason)`` of
    samples left out), ``from_cache`` (the plan was read from the cache or given), ``plan_digest``, ``steps``
    (packs per rank per epoch), ``num_samples``.
    """

    def __init__(
        self,
        dataset: Any,
        preprocessor: Preprocessor,
        config: PackingConfig | None = None,
        *,
        record_format: str | None = None,
        image_root: str | os.PathLike[str] | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        strategy: str = "bfd",
        plan: Plan | str | os.PathLike[str] | None = None,
        cache: str | os.PathLike[str] | bool | None = True,
        num_proc: int = 1,
        collator_kwargs: dict[str, Any] | None = None,
        progress: bool | None = None,
        balance: Any = None,
        **knobs: Any,
    ) -> None:
        Preprocessor.refuse_parts("PackedMapDataset", knobs)
        self.preprocessor = Preprocessor.check(preprocessor)
        config = PackingConfig.resolve("PackedMapDataset", config, refuse=("truncate",), **knobs)
        collator_kwargs = collator_options("PackedMapDataset", collator_kwargs)
        given = _given_plan(plan, rank)
        if world_size is None:
            world_size = given.world_size if given is not None else 1
        _check_world_size(world_size)
        if given is not None and world_size != given.world_size:
            raise ValueError(
                f"world_size={world_size} but the plan deals its packs to {given.world_size} ranks: pass "
                f"world_size={given.world_size} (or leave it out), or build a plan for {world_size} ranks."
            )
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) or None, got {rank!r}")
        self.dataset, root = open_dataset(dataset, image_root, "PackedMapDataset")
        self.config, self.world_size, self.rank, self.strategy = config, world_size, rank, strategy
        self.balance = balance
        self.record_format, self.image_root = record_format, root
        if "return_style" in collator_kwargs:
            raise ValueError(
                "items are PackedBatch (they carry the plan metadata): use trainer_collator(style) for the HF "
                "Trainer, or batch.model_inputs(style) in a training loop, instead of return_style"
            )
        # max_rows=1: a pack of the plan is one row, or the collator raises naming its samples
        self.collator_kwargs = {
            "pad_to_multiple_of": config.pad_to_multiple_of, "max_rows": 1, **collator_kwargs
        }
        self.epoch = 0
        self._arrow: Any = None
        key = self._key(cache if given is None else None, checking=given is not None)
        if given is not None:
            if key is not None:
                given.check(key, "the plan given" if given.path is None else f"the plan {given.path}")
            self.plan, self.from_cache = given, True
        else:
            self.plan, self.from_cache = self._cached_or_built(key, cache, num_proc, progress)
        self.plan_digest = self.plan.digest
        self.skipped: list[tuple[str, str, str]] = [tuple(s) for s in self.plan.skipped]
        self.steps = self.plan.micro_steps
        self.num_samples = self.plan.num_samples
        self._collator = self._make_collator()

    # ------------------------------------------------------------------ plan
    def _key(self, cache: Any, checking: bool) -> dict[str, Any] | None:
        """:func:`~vlm_pack.data.plan.plan_key` of this dataset; None (with a warning where a cache was asked
        for or a plan is to be checked) when the chat template cannot be fingerprinted."""
        try:
            return plan_key(
                self.dataset, self.preprocessor, self.config, world_size=self.world_size, strategy=self.strategy,
                record_format=self.record_format, image_root=self.image_root, balance=self.balance,
            )  # fmt: skip
        except Unfingerprintable as e:
            if checking:
                warnings.warn(
                    f"vlm-pack: cannot fingerprint the chat template: {e}. The plan given cannot be checked "
                    "against it and is used as it is.",
                    stacklevel=3,
                )
            elif cache is not None and cache is not False:
                warnings.warn(
                    f"vlm-pack: cannot fingerprint the chat template: {e}. A plan made with it cannot be "
                    "told from a plan made with another, so it is made anew and not cached. Hold only plain "
                    "values (strings, numbers, containers, functions) in the callable's closure, defaults "
                    "and globals, or pass cache=False.",
                    stacklevel=3,
                )
            return None

    def _cached_or_built(
        self, key: dict[str, Any] | None, cache: Any, num_proc: int, progress: bool | None
    ) -> tuple[Plan, bool]:
        """The plan from the cache (a stale or unreadable one is rebuilt), else built (and cached)."""
        path = _cache_path(cache, key_digest(key)) if key is not None else None
        if path is not None:
            cached = _load_cached(path, key, self.rank)
            if cached is not None:
                return cached, True
        built = make_plan(
            self.dataset, self.preprocessor, self.config, key, self.world_size, self.strategy,
            self.record_format, self.image_root, num_proc, progress, balance=self.balance,
        )  # fmt: skip
        if path is None:
            return built, False
        # read back mapped: DataLoader workers then map the folder instead of receiving copies of the arrays
        return Plan.load(built.save(path), rank=self.rank), False

    @property
    def _rows(self) -> np.ndarray:
        return self.plan.rows

    @property
    def _bin_ptr(self) -> np.ndarray:
        return self.plan.bin_ptr

    @property
    def _forecast(self) -> np.ndarray:
        return self.plan.lengths

    @property
    def _rank_bins(self) -> np.ndarray:
        return self.plan.rank_bins

    # ------------------------------------------------------------------ items
    def __len__(self) -> int:
        return self.steps * (self.world_size if self.rank is None else 1)

    def set_epoch(self, epoch: int) -> None:
        """Use the pack order of ``epoch`` (items given as plain ints; ``PackedSampler`` passes its own)."""
        self.epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """int64 ``[steps]``: which of a rank's packs comes at each micro-step of ``epoch``: whole optimizer
        steps (``plan.grad_accum`` micro-steps each) shuffled, a partial last one last. Computed once per epoch
        (the last epoch's is kept), so an item costs O(1) however many packs the plan holds."""
        cached = self.__dict__.get("_order")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = self._compute_order(epoch)
        order.setflags(write=False)  # shared by every item of the epoch
        self.__dict__["_order"] = (epoch, order)
        return order

    def _compute_order(self, epoch: int) -> np.ndarray:
        seed = self.config.shuffle_seed
        if seed is None:
            return np.arange(self.steps, dtype=np.int64)
        k = self.plan.grad_accum
        rng = np.random.default_rng([seed, epoch])
        if k == 1:  # the order of plans without steps, unchanged
            return rng.permutation(self.steps).astype(np.int64)
        blocks = block_order(-(-self.steps // k), self.steps // k, rng)
        micro = (blocks[:, None] * k + np.arange(k)).ravel()
        return micro[micro < self.steps].astype(np.int64)  # the partial step is last: only its tail goes

    def bin_of(self, index: int, epoch: int | None = None) -> tuple[int, int, int]:
        """``(rank, step, bin)`` of item ``index`` in ``epoch`` (default: the current one); O(1)."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack index {index} out of range for {len(self)} packs")
        rank, step = (
            (index % self.world_size, index // self.world_size) if self.rank is None else (self.rank, index)
        )
        epoch = self.epoch if epoch is None else epoch
        return rank, step, int(self._rank_bins[rank, self.order(epoch)[step]])

    def bins_in_order(self, epoch: int | None = None) -> np.ndarray:
        """int64 ``[len(self)]``: the plan's bin of every item of ``epoch`` (default: the current one), item
        order (``bin_of(i)[2]`` of each ``i``, in one vectorised step)."""
        epoch = self.epoch if epoch is None else epoch
        order = self.order(epoch)
        if self.rank is not None:
            return np.asarray(self._rank_bins[self.rank, order], dtype=np.int64)
        return np.asarray(self._rank_bins[:, order].T.reshape(-1), dtype=np.int64)  # item s*W + r

    def rows_of(self, bin_index: int) -> np.ndarray:
        """int64: the dataset rows of pack ``bin_index`` of the plan."""
        return self._rows[self._bin_ptr[bin_index] : self._bin_ptr[bin_index + 1]]

    def lengths_of(self, bin_index: int) -> np.ndarray:
        """int64: the forecast (processed) lengths of the samples of pack ``bin_index``, as ``rows_of``."""
        return self._forecast[self._bin_ptr[bin_index] : self._bin_ptr[bin_index + 1]]

    def __getitem__(self, item: int | tuple[int, int]) -> Any:
        """The pack of item ``item`` (an index, or ``(epoch, index)``) as a one-row ``PackedBatch``.

        A sample that fails to load is left out of its pack (``plan_info``'s ``left_out``, ``skipped``). A
        pack none of whose samples loads *gives way*: the item is the rank's next pack in the epoch's order
        whose samples load (after the last, the first), trained a second time this epoch in its place, so that
        every rank still yields ``steps`` packs in lock-step and each step's packs stay the same rank's. Its
        ``plan_info`` says so: ``stand_in_for`` is the bin that gave way (None otherwise), whose rows are all in
        ``left_out``; counting the ``rows`` of the items whose ``stand_in_for`` is None counts each sample
        packed once. A rank none of whose packs loads raises ``FailureBudgetError`` (systematic).
        """
        epoch, index = item if isinstance(item, tuple) else (self.epoch, item)
        epoch = int(epoch)
        rank, step, b = self.bin_of(int(index), epoch)
        processed, kept, failed = self._load_pack(b)
        left_out = [[row, reason] for row, (reason, _) in failed.items()]
        stand_in_for = None
        if not processed:
            stand_in_for, all_failed = b, failed
            order = self.order(epoch)
            for ahead in range(1, self.steps):
                b = int(self._rank_bins[rank, order[(step + ahead) % self.steps]])
                processed, kept, failed = self._load_pack(b)
                if processed:
                    break
                all_failed.update(failed)
            else:
                raise no_good_sample(f"PackedMapDataset rank {rank} (every pack of the epoch)", *tally(all_failed.values()))
            warnings.warn(
                f"vlm-pack: PackedMapDataset pack {stand_in_for} (rank {rank}, step {step}) has no sample that "
                f"loads ({len(left_out)} left out, reported); pack {b} stands in for it, trained a second time "
                "this epoch so that every rank keeps its steps",
                BadSampleWarning,
                stacklevel=2,
            )
        self._note_left_out(left_out)
        batch = self._collator(processed)
        info = {
            "epoch": epoch,
            "rank": rank,
            "step": step,
            "index": int(index),
            "bin": b,
            "rows": kept,
            "left_out": left_out,
            "lengths": [self.preprocessor.processed_length(p) for p in processed],
            "plan": self.plan_digest,
            "stand_in_for": stand_in_for,
        }
        batch.metadata[_META] = info  # a dataclass field: survives .to(device) and pin_memory()
        return batch

    def _load_pack(self, b: int) -> tuple[list[dict[str, Any]], list[int], dict[int, tuple[str, str]]]:
        """Each sample of bin ``b`` loaded: ``(processed, their rows, {row: (reason, example)} left out)``."""
        rows = self.rows_of(b)
        forecast = self._forecast[self._bin_ptr[b] : self._bin_ptr[b + 1]]
        processed, kept, failed = [], [], {}
        for row, length in zip(rows.tolist(), forecast.tolist()):
            out = self._load(row, length)
            if isinstance(out, Skip):  # left out
                failed[row] = (out.reason, out.example)
            else:
                processed.append(out)
                kept.append(row)
        return processed, kept, failed

    def _note_left_out(self, left_out: list[list[Any]]) -> None:
        """Add rows left out at load time to ``skipped`` (once each: a row fails the same way each epoch).

        In this process: the main one with ``num_workers=0``; with workers ``PackedSampler.observe`` adds them
        from the batch's ``plan_info`` in the main process."""
        if not left_out:
            return
        noted = self.__dict__.setdefault("_noted", set())
        for row, reason in left_out:
            if int(row) not in noted:
                noted.add(int(row))
                self.skipped.append((str(row), f"dataset[{row}]", reason))

    @property
    def _loading(self) -> Guard:
        """The guarded stage of loading packs, one per process (a DataLoader worker's own budget)."""
        if "_guard" not in self.__dict__:
            policy = FailurePolicy.of("PackedMapDataset", self.config, _warn_left_out)
            self.__dict__["_guard"] = policy.stage("loading packs", "decode_error")
        return self.__dict__["_guard"]

    def _load(self, row: int, forecast: int) -> dict[str, Any] | Skip:
        """``_process``, or a :class:`~vlm_pack.failures.Skip` for a row with bad data (a processed length
        that is not its forecast included): warned about, left out and counted in this process's failure
        budget; raised under ``on_error="raise"``; an error of code raises ``SampleCodeError`` naming the row."""
        sample = f"dataset row {row}"
        out = self._loading.call(self._process, row, forecast, sample=sample, key=str(row), where=row)
        if not isinstance(out, Skip):
            self._loading.good()
        return out

    def _process(self, row: int, forecast: int) -> dict[str, Any]:
        if self._arrow is None:  # Arrow rows: image bytes stay encoded until process_sample decodes them
            self._arrow = self.dataset.with_format("arrow")
        (record,) = self._arrow[row : row + 1].to_pylist()
        sample = normalise_record(
            record, record_format=self.record_format, key=str(row), where=f"dataset[{row}]", image_root=self.image_root
        )
        if self.config.max_image_pixels is not None:  # refused from its header, never decoded (as at plan time)
            image_sizes(sample, exif_transpose=self.config.exif_transpose, max_image_pixels=self.config.max_image_pixels)
        images = [im if not isinstance(im, str) else Path(im) for im in sample.images]
        job = SampleJob(sample.key, sample.label, images, sample.conversation, forecast, list(sample.videos), where=row)
        out = job.process(self.preprocessor)  # checked against the forecast it was packed on
        out["__key__"], out["__row__"] = sample.key, row
        return out

    def _make_collator(self) -> Callable[[list[dict[str, Any]]], Any]:
        return self.preprocessor.collator(self.config.capacity, **self.collator_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrow"] = None  # reopened lazily in each DataLoader worker
        state.pop("_guard", None)  # each worker counts its own run of bad samples
        state.pop("_order", None)  # recomputed once per epoch in each worker
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
def _given_plan(plan: Any, rank: int | None) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, str | os.PathLike):
        return Plan.load(plan, rank=rank)
    raise TypeError(f"plan= takes a vlm_pack.data.Plan or the folder Plan.save wrote, got {type(plan).__name__}")


def _cache_path(cache: str | os.PathLike[str] | bool | None, digest: str) -> Path | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        cache = Path(os.environ.get("VLM_PACK_CACHE", Path.home() / ".cache" / "vlm_pack")) / "plans"
    path = Path(cache)
    if path.suffix == ".npz":
        raise ValueError(
            f"cache={str(cache)!r}: plans are folders now, not .npz files; give a folder named "
            f"{path.with_suffix('.plan').name!r} to keep one plan (rebuilt when stale), or a folder of plans."
        )
    return path if path.suffix == ".plan" or (path / "plan.json").is_file() else path / f"plan-{digest}"


def _load_cached(path: Path, key: dict[str, Any], rank: int | None) -> Plan | None:
    if not path.exists():
        return None
    try:
        return Plan.load(path, rank=rank, expect=key)
    except StalePlanError as e:
        warnings.warn(
            f"vlm-pack: the cached plan {path} is stale ({shown_parts(e.changed)} changed); rebuilding it",
            stacklevel=5,
        )
    except (OSError, ValueError) as e:
        logger.warning("vlm-pack: plan cache %s is unreadable (%s); rebuilding it", path, e)
    return None


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
        """Record that ``batch`` was consumed (and its rows left out at load time in ``dataset.skipped``);
        returns it."""
        info = plan_info(batch)
        if info is None:
            raise ValueError("observe() takes batches of a PackedMapDataset (they carry plan metadata)")
        self.dataset._note_left_out(info["left_out"])
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
