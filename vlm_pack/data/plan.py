"""A plan: the bins over a ``datasets.Dataset``'s rows, dealt to ranks, with what made it (issues 23, 25).

Built once (:func:`build_plan`, or ``vlm-pack plan``), saved as a folder, read by every consumer
(:class:`~vlm_pack.data.PackedMapDataset` ``plan=``, each rank of a multi-node job) without forecasting
again. The arrays, for a plan of ``num_samples`` samples in ``num_bins = world_size * steps`` bins::

    rows       int64 [num_samples]            dataset row ids, bin by bin
    lengths    int64 [num_samples]            each sample's forecast (processed) length, as rows
    bin_ptr    int64 [num_bins + 1]           bin b holds rows[bin_ptr[b] : bin_ptr[b + 1]]
    rank_bins  int64 [world_size, steps]      the bin rank r trains on at micro-step s (before the epoch's
                                              shuffle); columns g*grad_accum .. (g+1)*grad_accum - 1 are
                                              optimizer step g (a step plan, ``packing.steps``)

    rows      │ 7  2  9 │ 4  0 │ 1  8  3  6 │ 5 │ ...     bins over row ids (a row appears at most once)
    bin_ptr     0         3      5            9   10
                └ bin 0 ┘ └ 1 ┘  └─ bin 2 ──┘ └3┘

    rank_bins       step 0   step 1   ...                 every rank has `steps` bins (lock-step)
        rank 0   │    2    │    0    │ ...
        rank 1   │    3    │    1    │ ...

By default the packs of one step cost about the same on every rank (:func:`~vlm_pack.packing.step_plan`,
``balance=StepBalance(...)``: grad accumulation, the model's cost, an image on every rank), and where the
best-fit packs cost too unequal amounts for any dealing, the plan makes its packs for the steps
(:func:`plan_packs`, ``StepBalance.packs``); ``balance=EpochBalance()`` balances each rank's epoch total only
(Karmarkar-Karp), the dealing before step plans.

``key`` is what made the plan (JSON): the dataset's fingerprint and row count, the preprocessor's
:func:`~vlm_pack.data.fingerprint.fingerprint` parts (tokenizer, processor, image processor, chat template,
vision spec, versions) and the packing settings (capacity, world_size, ...); ``digest`` names it. A consumer
with other parts gets a :class:`StalePlanError` naming the parts that changed (``packing.capacity``,
``chat.template``...), never a plan made for something else.

On disk (:meth:`Plan.save`, written to a temporary folder and renamed into place, so a reader never sees half
a plan)::

    plan_dir/
        plan.json        {"format", "digest", "key", "skipped", "arrays": {name: {"shape", "dtype"}}}
        rows.npy  lengths.npy  bin_ptr.npy  rank_bins.npy

:meth:`Plan.load` memory-maps the ``.npy`` files: a rank reads the pages of its own bins (its row of
``rank_bins``, then ``bin_ptr`` and ``rows`` of those bins) and nothing else, so its memory does not grow
with the dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._compat import dataset_fingerprint
from ..config import PackingConfig
from ..failures import example, no_good_sample, tally
from .fingerprint import Unfingerprintable, changed_parts, fingerprint
from .sources import open_sources

if TYPE_CHECKING:
    from ..packing.steps import EpochBalance, StepBalance
    from ..preprocessor import Preprocessor
    from .forecast import LengthTable

__all__ = ["Plan", "StalePlanError", "build_plan", "plan_key"]

PLAN_FORMAT = 3  # 3: a folder of .npy files + plan.json (2: one .npz file)
_ARRAYS = ("rows", "lengths", "bin_ptr", "rank_bins")
_META_FILE = "plan.json"
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
_FIX = (
    "rebuild it (vlm_pack.data.build_plan(...).save(path), or `vlm-pack plan DATASET_DIR --out PLAN_DIR`), "
    "or pass the template, processor and packing settings (capacity, world_size...) it was made with"
)


class StalePlanError(ValueError):
    """A plan made with other parts than the consumer's; ``changed`` names them (``["packing.capacity"]``)."""

    def __init__(self, message: str, changed: Sequence[str]) -> None:
        super().__init__(message)
        self.changed = list(changed)


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode("utf-8")).hexdigest()


def shown_parts(changed: Sequence[str], limit: int = 8) -> str:
    """``changed`` for a message: the first ``limit`` names, then how many more."""
    return ", ".join(changed[:limit]) + (f" and {len(changed) - limit} more" if len(changed) > limit else "")


@dataclass(frozen=True, eq=False)
class Plan:
    """The bins over a dataset's rows and the ranks they are dealt to, with the key that made them.

    Arrays (int64; see the module docstring for the drawing): ``rows [num_samples]``, ``lengths
    [num_samples]``, ``bin_ptr [num_bins + 1]``, ``rank_bins [world_size, steps]``. ``skipped``: ``(key,
    where, reason)`` of samples left out; ``key``: what made it (None when the chat template could not be
    fingerprinted); ``digest``: 16 hex digits naming it. ``rank``: the rank it was loaded for (None: all);
    ``path``: the folder it was loaded from (arrays memory-mapped), else None. ``grad_accum``: micro-steps per
    optimizer step in ``rank_bins`` (1 for ``EpochBalance``); a consumer shuffles whole steps.
    """

    rows: np.ndarray
    lengths: np.ndarray
    bin_ptr: np.ndarray
    rank_bins: np.ndarray
    skipped: tuple[tuple[str, str, str], ...] = ()
    key: dict[str, Any] | None = None
    digest: str = ""
    rank: int | None = None
    path: Path | None = field(default=None, repr=False)
    grad_accum: int = 1

    @property
    def world_size(self) -> int:
        return int(self.rank_bins.shape[0])

    @property
    def steps(self) -> int:
        """Bins per rank per epoch."""
        return int(self.rank_bins.shape[1])

    @property
    def num_bins(self) -> int:
        return int(self.bin_ptr.shape[0]) - 1

    @property
    def num_samples(self) -> int:
        return int(self.rows.shape[0])

    def rank_bins_of(self, rank: int) -> np.ndarray:
        """int64 ``[steps]``: the bins of ``rank``, by step."""
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is not in [0, {self.world_size}): the plan is for {self.world_size} ranks"
            )
        return self.rank_bins[rank]

    def rows_of(self, bin_index: int) -> np.ndarray:
        """int64: the dataset rows of bin ``bin_index``."""
        return self.rows[self.bin_ptr[bin_index] : self.bin_ptr[bin_index + 1]]

    def lengths_of(self, bin_index: int) -> np.ndarray:
        """int64: the forecast lengths of the samples of bin ``bin_index``, as :meth:`rows_of`."""
        return self.lengths[self.bin_ptr[bin_index] : self.bin_ptr[bin_index + 1]]

    def check(self, expect: dict[str, Any], where: str = "the plan") -> None:
        """Raise :class:`StalePlanError` naming the parts that differ when ``expect`` is not this plan's key."""
        if self.key == expect:
            return
        if self.key is None:
            raise StalePlanError(
                f"{where} records no key (it was made with a chat template that cannot be fingerprinted), so "
                f"it cannot be checked against these parts: {_FIX}, with a template holding plain values.",
                ["key"],
            )
        changed = changed_parts(self.key, expect)
        details = [d for d in (_change(self.key, expect, part) for part in changed[:4]) if d]
        raise StalePlanError(
            f"{where} is stale: {shown_parts(changed)} changed since it was made"
            + (f" ({'; '.join(details)})" if details else "")
            + f". {_FIX[0].upper()}{_FIX[1:]}.",
            changed,
        )

    # ------------------------------------------------------------------ disk
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as the folder ``path`` (``plan.json`` + one ``.npy`` per array), atomically: a
        temporary folder beside it renamed into place; a plan folder already there is replaced."""
        path = Path(path)
        _check_replaceable(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            shapes = {}
            for name in _ARRAYS:
                array = np.ascontiguousarray(getattr(self, name), dtype=np.int64)
                np.save(tmp / f"{name}.npy", array, allow_pickle=False)
                shapes[name] = {"shape": list(array.shape), "dtype": str(array.dtype)}
            meta = {
                "format": PLAN_FORMAT,
                "digest": self.digest,
                "key": self.key,
                "skipped": [list(s) for s in self.skipped],
                "arrays": shapes,
                "grad_accum": self.grad_accum,
            }
            (tmp / _META_FILE).write_text(json.dumps(meta, sort_keys=True))
            _move_into_place(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return path

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, rank: int | None = None, expect: dict[str, Any] | None = None
    ) -> Plan:
        """The plan saved in the folder ``path``, its arrays memory-mapped (read-only; ``rank`` reads only
        the pages of its bins). ``expect`` (a key, see :func:`plan_key`): a plan made with other parts raises
        :class:`StalePlanError` naming them. A folder that is not a whole plan raises ``ValueError`` naming
        the file."""
        path = Path(path)
        meta = _read_meta(path)
        arrays = {name: _read_array(path, name, meta["arrays"].get(name)) for name in _ARRAYS}
        _check_layout(path, arrays)
        plan = cls(
            **arrays,
            skipped=tuple(tuple(s) for s in meta.get("skipped", [])),
            key=meta.get("key"),
            digest=str(meta.get("digest", "")),
            rank=rank,
            path=path,
            grad_accum=int(meta.get("grad_accum", 1)),
        )
        if rank is not None:
            plan.rank_bins_of(rank)  # in range, or a ValueError naming the plan's world size
        if expect is not None:
            plan.check(expect, f"the plan {path}")
        return plan

    def __reduce__(self) -> tuple[Any, ...]:
        # a saved plan travels to DataLoader workers as its folder, mapped again there, not as copied arrays
        if self.path is not None:
            return (_reopen, (str(self.path), self.rank, self.digest))
        fields = {name: getattr(self, name) for name in (*_ARRAYS, "skipped", "key", "digest", "rank", "grad_accum")}
        return (_from_fields, (fields,))


def _from_fields(fields: dict[str, Any]) -> Plan:
    return Plan(**fields)


def _reopen(path: str, rank: int | None, digest: str) -> Plan:
    plan = Plan.load(path, rank=rank)
    if plan.digest != digest:
        raise ValueError(
            f"the plan folder {path} was replaced by plan {plan.digest} while plan {digest} was in use; "
            "restart the run, or keep a plan in use in its own folder"
        )
    return plan


def _change(old: Any, new: Any, part: str) -> str:
    """``"packing.capacity: 192 -> 384"`` for a part whose values are short, else ``""``."""
    for name in part.split(".") if part else []:
        old = old.get(name) if isinstance(old, dict) else None
        new = new.get(name) if isinstance(new, dict) else None
    short = all(
        v is None or (isinstance(v, str | int | float | bool) and len(str(v)) <= 40) for v in (old, new)
    )
    return f"{part}: {old!r} -> {new!r}" if short else ""


def _not_a_plan(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} is not a whole plan: {what}. Write it again with Plan.save / `vlm-pack plan`.")


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / _META_FILE
    if path.suffix == ".npz" and path.is_file():
        raise ValueError(
            f"{path} is a plan of the old one-file format: plans are folders now (plan.json + .npy files); "
            "build it again (vlm_pack.data.build_plan(...).save(folder), or `vlm-pack plan`)."
        )
    if not path.is_dir():
        raise FileNotFoundError(f"no plan folder at {path}: write one with Plan.save or `vlm-pack plan`.")
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise _not_a_plan(path, f"{_META_FILE} is missing (an interrupted copy?)") from None
    except (OSError, ValueError) as e:
        raise _not_a_plan(path, f"{_META_FILE} is unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), dict):
        raise _not_a_plan(path, f"{_META_FILE} holds no array table")
    if meta.get("format") != PLAN_FORMAT:
        raise ValueError(
            f"{path} is a plan of format {meta.get('format')!r}, this vlm-pack reads format {PLAN_FORMAT}: "
            "build it again with this version."
        )
    return meta


def _read_array(path: Path, name: str, expected: Any) -> np.ndarray:
    file = path / f"{name}.npy"
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise _not_a_plan(path, f"{name}.npy is missing") from None
    except (OSError, ValueError) as e:
        raise _not_a_plan(path, f"{name}.npy is unreadable ({e})") from None
    if (
        not isinstance(expected, dict)
        or list(array.shape) != expected.get("shape")
        or str(array.dtype) != expected.get("dtype")
    ):
        raise _not_a_plan(
            path,
            f"{name}.npy holds {array.dtype} {list(array.shape)}, {_META_FILE} says {expected!r} (a mix of two plans?)",
        )
    return array


def _check_layout(path: Path, a: dict[str, np.ndarray]) -> None:
    """The few reads that tell a consistent plan (the ends of ``bin_ptr``), not a scan of the arrays."""
    rows, bin_ptr, rank_bins = a["rows"], a["bin_ptr"], a["rank_bins"]
    if a["lengths"].shape != rows.shape or rank_bins.ndim != 2 or bin_ptr.ndim != 1 or bin_ptr.shape[0] < 2:
        raise _not_a_plan(path, "its arrays' shapes do not fit together")
    if int(bin_ptr[0]) != 0 or int(bin_ptr[-1]) != rows.shape[0] or rank_bins.size != bin_ptr.shape[0] - 1:
        raise _not_a_plan(
            path,
            f"bin_ptr runs {int(bin_ptr[0])}..{int(bin_ptr[-1])} over {rows.shape[0]} rows and "
            f"{bin_ptr.shape[0] - 1} bins for {rank_bins.size} rank slots",
        )


def _check_replaceable(path: Path) -> None:
    if path.exists() and not (path / _META_FILE).is_file() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{path} exists and is not a plan folder: give Plan.save a new or plan folder.")


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; a plan already there is moved aside first (a reader holding its maps keeps
    them: the files are unlinked, not rewritten)."""
    try:
        os.rename(tmp, path)
        return
    except OSError:
        if not path.exists():
            raise
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):  # another process moved it meanwhile
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if not (path / _META_FILE).is_file():  # another process's plan landed first: keep that one
            raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- building
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
    return _digest(json.dumps(key, sort_keys=True))[:16]


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
    rank's epoch total only). ``num_proc``: forecast processes (``DataLoader`` workers are ``num_workers``)."""
    from ..preprocessor import Preprocessor

    pre = Preprocessor.check(preprocessor)
    config = PackingConfig.resolve("build_plan", config, refuse=("truncate",), **knobs)
    _check_world_size(world_size)
    ds, root = open_dataset(dataset, image_root, "build_plan")
    key = plan_key_or_none(
        ds,
        pre,
        config,
        world_size=world_size,
        strategy=strategy,
        record_format=record_format,
        image_root=root,
        balance=balance,
    )
    return make_plan(
        ds, pre, config, key, world_size, strategy, record_format, root, num_proc, progress, balance=balance
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
    from ..packing import padded_lengths
    from .forecast import forecast_sources

    table = table if table is not None else forecast_sources(
        ds,
        preprocessor=pre,
        record_format=record_format,
        image_root=image_root,
        exif_transpose=cfg.exif_transpose,
        on_error=cfg.on_error,
        num_workers=num_proc,
        progress=progress,
        max_consecutive_failures=cfg.max_consecutive_failures,
    )
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
    members, bin_ptr, rank_bins, grad_accum = plan_packs(table, lengths, result, world_size, _balance(balance))
    arrays = {
        "rows": np.asarray(table.index[members], dtype=np.int64),
        "lengths": np.asarray(table.lengths[members], dtype=np.int64),
        "bin_ptr": bin_ptr,
        "rank_bins": rank_bins,
    }
    if key is not None:
        digest = key_digest(key)
    else:  # nothing names what made it: the plan is named by its own content
        digest = _digest(b"".join(arrays[n].tobytes() for n in ("rows", "bin_ptr", "rank_bins")))[:16]
    return Plan(**arrays, skipped=tuple(tuple(s) for s in skipped), key=key, digest=digest, grad_accum=grad_accum)


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
        has_image=None if balance.image_every_rank is False else np.diff(table.image_ptr)[kept] > 0,
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
    from ..packing.cost import PackCost, image_patches

    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    ptr = np.asarray(table.image_ptr, dtype=np.int64)
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
    """``(costs float64 [B], images int64 [B])`` of the packs ``members`` / ``bin_ptr`` (rows of ``table``)."""
    from ..packing.cost import gather_ragged, image_patches, pack_costs

    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    patches, image_ptr = gather_ragged(patches, table.image_ptr, members)
    costs = pack_costs(lengths[members], bin_ptr, patches, image_ptr, cost)
    images = np.add.reduceat(np.diff(image_ptr), bin_ptr[:-1]) if members.size else np.zeros(0, np.int64)
    return costs, images


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
