"""A plan: the bins over a ``datasets.Dataset``'s rows, dealt to ranks, with what made it, and its folder on
disk (issues 23, 25). :mod:`vlm_pack.data.plan` builds one.

The arrays, for a plan of ``num_samples`` samples in ``num_bins`` bins, ``micro_steps = num_bins /
world_size`` per rank::

    rows       int64 [num_samples]            dataset row ids, bin by bin
    lengths    int64 [num_samples]            each sample's forecast (processed) length, as rows
    bin_ptr    int64 [num_bins + 1]           bin b holds rows[bin_ptr[b] : bin_ptr[b + 1]]
    rank_bins  int64 [world_size, micro_steps]  the bin rank r trains on at micro-step s (before the epoch's
                                              shuffle); columns g*grad_accum .. (g+1)*grad_accum - 1 are
                                              optimizer step g (a step plan, ``packing.steps``)

    rows      │ 7  2  9 │ 4  0 │ 1  8  3  6 │ 5 │ ...     bins over row ids (a row appears at most once)
    bin_ptr     0         3      5            9   10
                └ bin 0 ┘ └ 1 ┘  └─ bin 2 ──┘ └3┘

    rank_bins    micro 0  micro 1   ...                   every rank has `micro_steps` bins (lock-step)
        rank 0   │    2    │    0    │ ...
        rank 1   │    3    │    1    │ ...

``key`` is what made the plan (JSON): the dataset's fingerprint and row count, the preprocessor's
:func:`~vlm_pack.data.fingerprint.fingerprint` parts (tokenizer, processor, image processor, chat template,
vision spec, versions) and the packing settings (capacity, world_size, the balance and its cost model ...);
``digest`` names it. A consumer with other parts gets a :class:`StalePlanError` naming the parts that changed
(``packing.capacity``, ``chat.template``...), never a plan made for something else. ``cost`` records the
cost model the packs were dealt by (a ``PackCost``'s fields, a callable's name, or ``"tokens"``), also where
``key`` is None.

On disk (:meth:`Plan.save`, written to a temporary folder and renamed into place, so a reader never sees half
a plan)::

    plan_dir/
        plan.json        {"format", "digest", "key", "skipped", "grad_accum", "cost", "arrays": {name: {"shape", "dtype"}}}
        rows.npy  lengths.npy  bin_ptr.npy  rank_bins.npy

:meth:`Plan.load` memory-maps the ``.npy`` files: a rank reads the pages of its own bins (its row of
``rank_bins``, then ``bin_ptr`` and ``rows`` of those bins) and nothing else, so its memory does not grow
with the dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .fingerprint import changed_parts

__all__ = ["PLAN_FORMAT", "Plan", "StalePlanError", "digest_of", "shown_parts"]

PLAN_FORMAT = 3  # 3: a folder of .npy files + plan.json (2: one .npz file)
_ARRAYS = ("rows", "lengths", "bin_ptr", "rank_bins")
_META_FILE = "plan.json"

_FIX = (
    "rebuild it (vlm_pack.data.build_plan(...).save(path), or `vlm-pack plan DATASET_DIR --out PLAN_DIR`), "
    "or pass the template, processor and packing settings (capacity, world_size...) it was made with"
)


class StalePlanError(ValueError):
    """A plan made with other parts than the consumer's; ``changed`` names them (``["packing.capacity"]``)."""

    def __init__(self, message: str, changed: Sequence[str]) -> None:
        super().__init__(message)
        self.changed = list(changed)


def digest_of(text: str | bytes) -> str:
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
    optimizer step in ``rank_bins`` (1 for ``EpochBalance``); a consumer shuffles whole steps. ``cost``: the
    cost model its packs were dealt by: a ``PackCost``'s fields (``PackCost(**plan.cost)`` rebuilds it), a
    callable's qualified name, ``"tokens"`` (``EpochBalance``), or None (a plan saved before it was recorded).
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
    cost: dict[str, Any] | str | None = None

    @property
    def world_size(self) -> int:
        return int(self.rank_bins.shape[0])

    @property
    def micro_steps(self) -> int:
        """Bins (micro-batches) per rank per epoch: the columns of ``rank_bins``."""
        return int(self.rank_bins.shape[1])

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch: ``micro_steps / grad_accum``, a last partial step counted."""
        return -(-self.micro_steps // self.grad_accum)

    @property
    def num_bins(self) -> int:
        return int(self.bin_ptr.shape[0]) - 1

    @property
    def num_samples(self) -> int:
        return int(self.rows.shape[0])

    def rank_bins_of(self, rank: int) -> np.ndarray:
        """int64 ``[micro_steps]``: the bins of ``rank``, by micro-step."""
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
                "cost": self.cost,
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
            cost=meta.get("cost"),
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
        names = (*_ARRAYS, "skipped", "key", "digest", "rank", "grad_accum", "cost")
        fields = {name: getattr(self, name) for name in names}
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
