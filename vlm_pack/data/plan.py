"""Building a :class:`~vlm_pack.data.plan_folder.Plan`: forecast, pack, deal the packs to ranks (issues 23, 25, 34).

Built once (:func:`build_plan` from a dataset, :func:`plan_from_lengths` from a lengths table, or ``vlm-pack
plan``), saved as a folder, read by every consumer (:class:`~vlm_pack.data.PackedMapDataset` ``plan=``, each
rank of a multi-node job) without forecasting again.

By default the packs of one step cost about the same on every rank (:func:`~vlm_pack.packing.step_plan`,
``balance=StepBalance(...)``: grad accumulation, the model's cost, an image on every rank), and where the
best-fit packs cost too unequal amounts for any dealing, the plan makes its packs for the steps
(:func:`plan_packs`, ``StepBalance.packs``); ``balance=EpochBalance()`` balances each rank's epoch total only
(Karmarkar-Karp), the dealing before step plans. The cost is the model's: ``StepBalance(cost=
PackCost.from_config(model.config))`` (``vlm-pack plan --model-config``); the plan records it (``Plan.cost``)
and its key holds it, so a consumer planning for another model's cost gets a ``StalePlanError`` naming
``packing.balance.cost``.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._compat import dataset_fingerprint
from ..config import PackingConfig
from ..failures import example, no_good_sample, tally
from .fingerprint import Unfingerprintable, fingerprint
from .plan_folder import PLAN_FORMAT, Plan, StalePlanError, digest_of, shown_parts
from .plan_folder import _check_replaceable as _check_replaceable  # read by the CLI before its forecast
from .sources import open_sources

if TYPE_CHECKING:
    from ..packing.steps import EpochBalance, StepBalance
    from ..preprocessor import Preprocessor
    from .forecast import LengthTable

__all__ = ["Plan", "StalePlanError", "build_plan", "plan_from_lengths", "plan_key", "shown_parts"]

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


def open_dataset(dataset: Any, image_root: Any, who: str) -> tuple[Any, Path | None]:
    """``(datasets.Dataset, image_root)`` of one dataset or ``save_to_disk`` folder; anything else (files,
    a glob) is refused naming what was found and what to use."""
    opened = open_sources([dataset], image_root=image_root)
    if len(opened) != 1 or opened[0].kind != "dataset":
        named = ", ".join(s.name for s in opened[:3]) + (", ..." if len(opened) > 3 else "")
        raise ValueError(
            f"{who}({dataset!r}) found {len(opened)} source(s) that are not one dataset "
            f"({named}): it reads rows by index, so give one datasets.Dataset or save_to_disk folder "
            "(load parquet / JSON / shards with datasets.load_dataset first); for streaming use "
            "PackedWebDataset, for TRL integrations.trl.packed_dataset (it takes any source)."
        )
    (source,) = opened
    return source.ref, source.image_root


def plan_key(
    dataset: Any,
    preprocessor: Preprocessor,
    config: PackingConfig,
    *,
    world_size: int = 1,
    strategy: str = "bfd",
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    balance: StepBalance | EpochBalance | None = None,
) -> dict[str, Any]:
    """What a plan of ``dataset`` (a ``datasets.Dataset``) is a function of: its fingerprint and row count,
    the preprocessor's :func:`fingerprint` parts and the packing settings. Raises
    :class:`~vlm_pack.data.fingerprint.Unfingerprintable` when the chat template cannot be fingerprinted."""
    _, parts = fingerprint(preprocessor)
    return {
        "format": PLAN_FORMAT,
        "dataset": {"fingerprint": dataset_fingerprint(dataset), "rows": len(dataset)},
        **parts,
        "packing": {
            **{f: getattr(config, f) for f in _PLAN_FIELDS},
            "strategy": strategy,
            "world_size": world_size,
            "record_format": record_format,
            "image_root": None if image_root is None else str(image_root),
            "balance": _balance(balance).key(),
        },
    }


def plan_key_or_none(*args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """:func:`plan_key`, or None when the chat template cannot be fingerprinted (the plan is then named by
    its own arrays, and cannot be checked against a consumer's parts)."""
    try:
        return plan_key(*args, **kwargs)
    except Unfingerprintable:
        return None


def key_digest(key: dict[str, Any]) -> str:
    return digest_of(json.dumps(key, sort_keys=True))[:16]


def build_plan(
    dataset: Any,
    preprocessor: Preprocessor,
    config: PackingConfig | None = None,
    *,
    world_size: int = 1,
    strategy: str = "bfd",
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    num_proc: int = 1,
    progress: bool | None = None,
    balance: StepBalance | EpochBalance | None = None,
    **knobs: Any,
) -> Plan:
    """Forecast ``dataset`` (a ``datasets.Dataset`` or ``save_to_disk`` folder; header-only, ``num_proc``
    processes), pack it with ``config`` (and keywords over it: ``capacity=``...; ``oversized="truncate"`` is
    refused, a plan never cuts a sample) and deal the bins to ``world_size`` ranks, the same number each,
    balanced by cost: a :class:`Plan` keyed by :func:`plan_key` (``key=None`` when the chat template cannot
    be fingerprinted; the digest then names the arrays). Samples left out are warned about and listed in
    ``skipped``; an epoch with no good sample raises. ``balance``: a
    :class:`~vlm_pack.packing.StepBalance` (default ``StepBalance()``: each step's packs cost about the same on
    every rank, see :func:`~vlm_pack.packing.step_plan`) or :class:`~vlm_pack.packing.EpochBalance` (each
    rank's epoch total only); or its fields as keywords (``grad_accum=4, cost=PackCost.from_config(...)``).
    ``num_proc``: forecast processes (``DataLoader`` workers are ``num_workers``)."""
    from ..preprocessor import Preprocessor

    pre = Preprocessor.check(preprocessor)
    config, balance = resolve_settings("build_plan", config, balance, knobs)
    _check_world_size(world_size)
    ds, root = open_dataset(dataset, image_root, "build_plan")
    return plan_dataset(ds, pre, config, world_size, strategy, record_format, root, balance, num_proc, progress)


def plan_dataset(
    ds: Any,
    pre: Preprocessor,
    cfg: PackingConfig,
    world_size: int,
    strategy: str,
    record_format: str | None,
    image_root: Path | None,
    balance: StepBalance | EpochBalance | None,
    num_proc: int = 1,
    progress: bool | None = None,
    table: LengthTable | None = None,
) -> Plan:
    """:func:`make_plan` of an opened dataset keyed by :func:`plan_key_or_none` (``ds`` None: sources that are
    not one dataset, planned from ``table`` and named by its content): what :func:`build_plan` and
    ``build_plan_ray`` both end with."""
    key = None
    if ds is not None:
        key = plan_key_or_none(
            ds, pre, cfg, world_size=world_size, strategy=strategy, record_format=record_format,
            image_root=image_root, balance=balance,
        )  # fmt: skip
    return make_plan(
        ds, pre, cfg, key, world_size, strategy, record_format, image_root, num_proc, progress, balance=balance,
        table=table,
    )  # fmt: skip


def forecast_settings(cfg: PackingConfig) -> dict[str, Any]:
    """The forecast's keyword arguments a :class:`PackingConfig` sets (``forecast_sources``, ``forecast_ray``)."""
    return {
        "exif_transpose": cfg.exif_transpose,
        "on_error": cfg.on_error,
        "max_consecutive_failures": cfg.max_consecutive_failures,
        "max_bad_fraction": cfg.max_bad_fraction,
        "max_image_pixels": cfg.max_image_pixels,
    }


def plan_from_lengths(
    lengths: LengthTable | str | os.PathLike[str],
    config: PackingConfig | None = None,
    *,
    world_size: int = 1,
    strategy: str = "bfd",
    balance: StepBalance | EpochBalance | None = None,
    dataset: Any = None,
    preprocessor: Preprocessor | None = None,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    **knobs: Any,
) -> Plan:
    """The :class:`Plan` of a lengths table, nothing forecast: ``lengths`` is a
    :class:`~vlm_pack.data.LengthTable` (``forecast_sources``, ``forecast_ray``, your own pipeline's) or the
    parquet file ``read_lengths`` reads (``vlm-pack analyze --lengths FILE``).

    Packs and deals as :func:`build_plan` does; the keywords are :class:`~vlm_pack.PackingConfig`'s
    (``capacity=``, ``max_samples_per_bin=``, ``oversized=``...) over ``config`` and
    :class:`~vlm_pack.packing.StepBalance`'s (``grad_accum=``, ``cost=``, ``image_every_rank=``, ``seed=``,
    ``packs=``) instead of ``balance=``::

        plan = plan_from_lengths("train.lengths.parquet", capacity=16384, world_size=64, grad_accum=4,
                                 cost=PackCost.from_config(model.config))

    The plan's ``rows`` are the table's row ids (``LengthTable.index``; positions where it has none). Keyed by
    :func:`plan_key` when ``dataset`` (the ``datasets.Dataset`` the table was forecast from) and
    ``preprocessor`` (what forecast it) are given, so ``PackedMapDataset(dataset, preprocessor, plan=)`` takes
    it; else it has no key (named by its arrays) and serves a loop that reads ``rank_bins_of`` / ``rows_of``.
    """
    from .lengths import read_lengths

    config, balance = resolve_settings("plan_from_lengths", config, balance, knobs)
    _check_world_size(world_size)
    table = lengths if not isinstance(lengths, str | os.PathLike) else read_lengths(lengths)
    key = None
    if (dataset is None) != (preprocessor is None):
        raise TypeError("plan_from_lengths: give dataset= and preprocessor= together (the key needs both), or neither")
    if dataset is not None:
        from ..preprocessor import Preprocessor

        ds, root = open_dataset(dataset, image_root, "plan_from_lengths")
        _check_table_of(table, ds)
        key = plan_key_or_none(
            ds, Preprocessor.check(preprocessor), config, world_size=world_size, strategy=strategy,
            record_format=record_format, image_root=root, balance=balance,
        )  # fmt: skip
    return plan_of_table(table, config, key, world_size=world_size, strategy=strategy, balance=balance)


def resolve_settings(
    who: str, config: PackingConfig | None, balance: Any, knobs: dict[str, Any]
) -> tuple[PackingConfig, Any]:
    """``(PackingConfig, balance)`` of an entry point's arguments: ``knobs`` named as ``StepBalance``'s fields
    make its balance (not with ``balance=`` too), the rest go over ``config``."""
    import dataclasses

    from ..packing.steps import StepBalance

    fields = {f.name for f in dataclasses.fields(StepBalance)}
    step = {k: knobs.pop(k) for k in list(knobs) if k in fields}
    if step and balance is not None:
        raise TypeError(f"{who}: {', '.join(sorted(step))} given with balance=: put them in the StepBalance")
    config = PackingConfig.resolve(who, config, refuse=("truncate",), **knobs)
    return config, (StepBalance(**step) if step else balance)


def _check_table_of(table: Any, ds: Any) -> None:
    """Refuse a lengths table that cannot be ``ds``'s forecast (row ids outside it, or more rows than it)."""
    index = table.index
    rows = len(table) + len(table.invalid)
    if index is None or rows != len(ds) or (len(index) and int(np.max(index)) >= len(ds)):
        raise ValueError(
            f"plan_from_lengths: the lengths table holds {rows:,} records"
            + (" without row ids" if index is None else "")
            + f", the dataset {len(ds):,} rows: forecast this dataset (forecast_sources(dataset, preprocessor=...)) "
            "or leave dataset= out."
        )


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def make_plan(
    ds: Any,
    pre: Preprocessor,
    cfg: PackingConfig,
    key: dict[str, Any] | None,
    world_size: int,
    strategy: str,
    record_format: str | None,
    image_root: Path | None,
    num_proc: int,
    progress: bool | None,
    *,
    balance: StepBalance | EpochBalance | None = None,
    table: LengthTable | None = None,
) -> Plan:
    """:func:`build_plan` of an opened dataset whose ``key`` is known (``PackedMapDataset`` computes it once
    to look up its cache); ``table``: its forecast, made already (``vlm_pack.integrations.ray``)."""
    from .forecast import forecast_sources

    table = table if table is not None else forecast_sources(
        ds, preprocessor=pre, record_format=record_format, image_root=image_root, num_proc=num_proc,
        progress=progress, **forecast_settings(cfg),
    )  # fmt: skip
    return plan_of_table(table, cfg, key, world_size=world_size, strategy=strategy, balance=balance)


def plan_of_table(
    table: LengthTable,
    cfg: PackingConfig,
    key: dict[str, Any] | None,
    *,
    world_size: int,
    strategy: str,
    balance: StepBalance | EpochBalance | None,
) -> Plan:
    """The plan of a forecast ``table`` under ``cfg`` (settings checked), keyed by ``key`` (None: named by
    its arrays): pack, leave out and list what fits nowhere, deal (:func:`plan_packs`)."""
    from ..packing import padded_lengths

    skipped = [list(s) for s in table.invalid]
    lengths = padded_lengths(table.lengths, cfg.pad_to_multiple_of)  # the spans the collator lays out
    over = np.flatnonzero(lengths > cfg.capacity)
    if over.size and cfg.oversized == "raise":
        i = int(over[0])
        raise ValueError(
            f"{table.sources[i]} (key {table.keys[i]!r}): {int(table.lengths[i])} tokens exceed capacity "
            f"{cfg.capacity}; raise capacity or pass PackingConfig(oversized='skip')."
        )
    # the plan keeps creation order: shuffle_seed orders its packs per epoch (set_epoch), not here
    result = table.pack(cfg.replace(oversized="skip", shuffle_seed=None), strategy, lengths=lengths)
    skipped += [[table.keys[u.index], table.sources[u.index], u.reason] for u in result.unpacked]
    if skipped:
        shown = "; ".join(f"{k} ({w}): {r}" for k, w, r in skipped[:3])
        warnings.warn(f"vlm-pack: {len(skipped)} sample(s) left out of the plan: {shown}", stacklevel=4)
    if result.num_bins == 0:  # the failure policy's epoch with no good sample (vlm_pack.failures)
        reasons = list(table.invalid_reasons)
        reasons += [
            "too_long" if lengths[u.index] > cfg.capacity else "vision_too_large" for u in result.unpacked
        ]
        failures = [(reason, example(f"{w} (key {k!r})", r)) for reason, (k, w, r) in zip(reasons, skipped)]
        raise no_good_sample("PackedMapDataset plan", *tally(failures))
    balance = _balance(balance)
    members, bin_ptr, rank_bins, grad_accum = plan_packs(table, lengths, result, world_size, balance)
    index = table.index if table.index is not None else np.arange(len(table), dtype=np.int64)
    arrays = {
        "rows": np.asarray(index[members], dtype=np.int64),
        "lengths": np.asarray(table.lengths[members], dtype=np.int64),
        "bin_ptr": bin_ptr,
        "rank_bins": rank_bins,
    }
    if key is not None:
        digest = key_digest(key)
    else:  # nothing names what made it: the plan is named by its own content
        digest = digest_of(b"".join(arrays[n].tobytes() for n in ("rows", "bin_ptr", "rank_bins")))[:16]
    skips = tuple(tuple(s) for s in skipped)
    return Plan(**arrays, skipped=skips, key=key, digest=digest, grad_accum=grad_accum, cost=cost_record(balance))


def cost_record(balance: StepBalance | EpochBalance) -> dict[str, Any] | str:
    """What a plan records of the cost it was dealt by: a ``PackCost``'s fields (``PackCost()``'s, Qwen2-VL-7B,
    for ``cost=None``), a callable's qualified name, or ``"tokens"`` (``EpochBalance``: each rank's token total)."""
    from ..packing.cost import PackCost
    from ..packing.steps import EpochBalance

    if isinstance(balance, EpochBalance):
        return "tokens"
    cost = balance.cost if balance.cost is not None else PackCost()
    return cost.to_dict() if isinstance(cost, PackCost) else balance.key()["cost"]


def _balance(balance: StepBalance | EpochBalance | None) -> Any:
    from ..packing.steps import EpochBalance, StepBalance

    if balance is None:
        return StepBalance()
    if isinstance(balance, StepBalance | EpochBalance):
        return balance
    raise ValueError(
        f"balance must be a vlm_pack.packing.StepBalance (step plans; default StepBalance()) or EpochBalance() "
        f"(each rank's epoch total only), got {balance!r}"
    )


def deal_packs(
    table: Any,
    lengths: np.ndarray,
    members: np.ndarray,
    bin_ptr: np.ndarray,
    world_size: int,
    balance: StepBalance | EpochBalance,
) -> tuple[np.ndarray, int]:
    """``(rank_bins int64 [world_size, B // world_size], grad_accum)`` of the packs ``members`` (forecast
    rows of ``table``, pack by pack: pack b is ``members[bin_ptr[b]:bin_ptr[b + 1]]``; ``lengths`` ``[N]``
    padded spans of all of ``table``'s samples): a :func:`~vlm_pack.packing.step_plan` costed by
    ``balance.cost``, or for ``EpochBalance`` each rank's total balanced (Karmarkar-Karp, the same count each)."""
    from ..packing import balance_bins
    from ..packing.steps import EpochBalance, step_plan

    if isinstance(balance, EpochBalance):
        bins = [lengths[members[a:b]].tolist() for a, b in itertools.pairwise(bin_ptr.tolist())]
        parts = balance_bins(bins, world_size, equal_count=True)
        return np.asarray(parts, dtype=np.int64).reshape(world_size, -1), 1
    costs, images = _costs_and_images(table, lengths, members, bin_ptr, balance.cost)
    every_rank = balance.image_every_rank if balance.image_every_rank is not None else bool(images.any())
    rank_bins = step_plan(
        costs, world_size, balance.grad_accum, has_image=images > 0 if every_rank else None, seed=balance.seed
    )
    return rank_bins, balance.grad_accum


def plan_packs(
    table: Any, lengths: np.ndarray, result: Any, world_size: int, balance: StepBalance | EpochBalance
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(members [n], bin_ptr [B + 1], rank_bins [world_size, B // world_size], grad_accum)``: the packs a
    plan trains on and their dealing. ``result``: the best-fit :class:`~vlm_pack.packing.PackResult` of
    ``table``'s samples (``lengths`` ``[N]`` their padded spans); its packs, the largest split until the
    ranks divide them, dealt by :func:`deal_packs`. With ``balance.packs == "balanced"`` the same samples
    are also packed for the steps (:func:`~vlm_pack.packing.balanced.balanced_packs`, under ``result``'s
    limits) and those packs are kept where :func:`~vlm_pack.packing.balanced.keep_balanced` says (no more
    optimizer steps, the image rule kept, a lower step imbalance); else (or when there are fewer samples than
    one step has packs) the best-fit ones."""
    from ..packing.balanced import balanced_packs, deal_units, keep_balanced
    from ..packing.steps import AUTO_BALANCED_MAX_SAMPLES, EpochBalance

    bins = _split_for_ranks([np.asarray(b, dtype=np.int64) for b in result.bins], world_size)
    members = np.concatenate(bins)
    bin_ptr = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    rank_bins, grad_accum = deal_packs(table, lengths, members, bin_ptr, world_size, balance)
    if isinstance(balance, EpochBalance) or balance.packs == "bfd" or world_size == 1:  # one rank never waits
        return members, bin_ptr, rank_bins, grad_accum
    kept = np.sort(members)
    if balance.packs == "auto" and kept.size > AUTO_BALANCED_MAX_SAMPLES:
        return members, bin_ptr, rank_bins, grad_accum
    costs = sample_costs(table, lengths, balance.cost)
    made = balanced_packs(
        costs[kept],
        lengths[kept],
        result.capacity,
        bin_ptr.size - 1,
        world_size=world_size,
        grad_accum=grad_accum,
        vision=None if result.vision is None else result.vision[kept],
        vision_capacity=result.vision_capacity,
        max_samples_per_bin=result.max_samples_per_bin,
        has_image=None if balance.image_every_rank is False else vision_inputs(table)[kept] > 0,
    )
    if made is None:
        return members, bin_ptr, rank_bins, grad_accum
    new_members, new_ptr = kept[made[0]], made[1]
    new_costs, new_images = _costs_and_images(table, lengths, new_members, new_ptr, balance.cost)
    every_rank = balance.image_every_rank if balance.image_every_rank is not None else bool(new_images.any())
    new_bins = deal_units(
        new_costs, world_size, grad_accum, has_image=new_images > 0 if every_rank else None, seed=balance.seed
    )
    old_costs, old_images = _costs_and_images(table, lengths, members, bin_ptr, balance.cost)
    new, old = (new_costs, new_images > 0, new_bins), (old_costs, old_images > 0, rank_bins)
    if keep_balanced(new, old, grad_accum, every_rank):  # no more steps, the image rule kept, better balanced
        return new_members, new_ptr, new_bins, grad_accum
    return members, bin_ptr, rank_bins, grad_accum


def sample_costs(table: Any, lengths: np.ndarray, cost: Any) -> np.ndarray:
    """float64 ``[N]``: the cost of each of ``table``'s samples alone (``lengths`` ``[N]`` padded spans): a
    :class:`~vlm_pack.packing.PackCost`'s, vectorised, or a callable's on a pack of that one sample (one
    call per sample: the balanced packs treat a pack's cost as the sum of its samples')."""
    from ..packing.cost import PackCost

    patches, ptr = table_patches(table)
    lengths = np.asarray(lengths, dtype=np.int64)
    cost = PackCost() if cost is None else cost
    if isinstance(cost, PackCost):
        return cost.sample_costs(lengths, patches, ptr)
    return np.array(
        [float(cost(lengths[i : i + 1], patches[ptr[i] : ptr[i + 1]])) for i in range(lengths.size)],
        dtype=np.float64,
    )


def _costs_and_images(
    table: Any, lengths: np.ndarray, members: np.ndarray, bin_ptr: np.ndarray, cost: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``(costs float64 [B], images int64 [B])`` of the packs ``members`` / ``bin_ptr`` (rows of ``table``);
    ``images``: the vision tower's inputs of each pack, its images and videos (:func:`vision_inputs`)."""
    from ..packing.cost import gather_ragged, pack_costs

    patches, ptr = table_patches(table)
    patches, unit_ptr = gather_ragged(patches, ptr, members)
    costs = pack_costs(lengths[members], bin_ptr, patches, unit_ptr, cost)
    inputs = vision_inputs(table)[members]
    images = np.add.reduceat(inputs, bin_ptr[:-1]) if members.size else np.zeros(0, np.int64)
    return costs, images


def vision_inputs(table: Any) -> np.ndarray:
    """int64 ``[N]``: what each sample feeds the vision tower, its images and its videos: a video runs the
    same tower (Qwen-VL's ``visual`` takes ``pixel_values_videos``; LLaVA-OneVision and InternVL encode its
    frames as images), so a rank holding only videos in a step does not leave the tower's parameters
    unused (the image rule of :func:`~vlm_pack.packing.step_plan`)."""
    images = np.diff(np.asarray(table.image_ptr, dtype=np.int64))
    videos = getattr(table, "num_videos", None)
    return images if videos is None else images + np.asarray(videos, dtype=np.int64)


def table_patches(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(patches int64 [U], ptr int64 [N + 1])``: the vision tower's attention units of each of ``table``'s
    samples, images then video frame groups (:func:`~vlm_pack.packing.cost.vision_patches`)."""
    from ..packing.cost import vision_patches

    return vision_patches(
        table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches,
        getattr(table, "num_videos", None), getattr(table, "video_groups", None),
        getattr(table, "video_group_patches", None),
    )  # fmt: skip


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
