"""One object for the packing and streaming knobs, shared by the packers, the streaming pipeline and the CLI.

``PackingConfig`` is the single place where a knob is named, defaulted and validated: ``StreamPacker``,
``PackedWebDataset`` and ``vlm-pack analyze | pack`` all take one, so a value means the same thing
everywhere and a bad value fails at construction, in the main process, with the fix in the message.

```python
cfg = PackingConfig(capacity=16384, max_samples_per_bin=32)
cfg = cfg.replace(buffer_size=512)          # a new, validated config
PackingConfig.from_dict(cfg.to_dict()) == cfg
```
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

#: The values of ``oversized`` (a sample longer than ``capacity``) at every entry point; default "raise".
OVERSIZED = ("raise", "skip", "truncate")
#: The values of ``on_error`` (a sample whose data cannot be read) at every entry point; default "skip".
ON_ERROR = ("raise", "skip")
#: Default ``max_image_pixels``: Pillow's own default ``Image.MAX_IMAGE_PIXELS`` (1024**3 // 4 // 3), fixed
#: here so that a training script that switches Pillow's check off (``Image.MAX_IMAGE_PIXELS = None``)
#: does not switch this one off too.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
#: The values of ``vision_cost`` (what ``vision_capacity`` counts).
VISION_COST = ("patches", "images")
#: Default ``max_consecutive_failures``: Megatron-Energon's default failure tolerance.
DEFAULT_MAX_CONSECUTIVE_FAILURES = 100
#: Default ``max_bad_fraction``: more than one bad sample in ten is not a few bad files, it is a wrong path or
#: setting (judged once a stage has seen ``vlm_pack.failures.MIN_SEEN_FOR_FRACTION`` samples).
DEFAULT_MAX_BAD_FRACTION = 0.1


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse a ``value`` of setting ``name`` outside ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_layout(who: str, names: Any) -> None:
    """Raise ``TypeError`` for ``layout=`` among the settings of ``who``: it names the token layout, a
    ``Preprocessor``'s, never the record format."""
    if "layout" in names:
        raise TypeError(
            f"{who}: layout= names the token layout only (Preprocessor(layout='expanded' | 'collapsed')); the "
            "record format (webdataset, llava, sharegpt, messages, caption) is record_format="
        )


def collator_options(who: str, collator_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``collator_kwargs`` of a dataset, refusing a packing setting: the plan and the collator must agree on
    it, so it is a keyword of the dataset (``pad_to_multiple_of=``), which passes it to both."""
    options = dict(collator_kwargs or {})
    packing = {f.name for f in dataclasses.fields(PackingConfig)}
    settings = sorted(set(options) & packing)
    if settings:
        names = ", ".join(f"{name}=" for name in settings)
        raise TypeError(
            f"{who}: collator_kwargs {settings} hold packing settings; pass {names} to {who} itself (it plans "
            "with them and gives the collator the same values)"
        )
    return options


def check_fraction(value: Any, name: str = "max_bad_fraction") -> float | None:
    """``value`` as a share of bad samples in [0, 1), or None (no limit); else ``ValueError`` saying so."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(
            f"{name} must be a share of bad samples in [0, 1) (0.1: one in ten) or None (no limit), got {value!r}"
        )
    return float(value)


def _positive_int(value: Any, name: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        hint = " or None" if optional else ""
        raise ValueError(f"{name} must be a positive integer{hint}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class PackingConfig:
    """Packing knobs (``capacity`` .. ``oversized``) and streaming knobs (``shuffle_seed`` ..).

    Packing:
        capacity: tokens per pack (a row of the batch), counted in the layout the model attends over.
        buffer_size: open bins the streaming packer keeps (memory bound; larger fills better).
        min_fill_ratio: a streaming bin leaves as soon as it is this full, in (0, 1].
        drop_last: at the end of a stream, drop bins below ``min_fill_ratio`` instead of emitting them.
        max_samples_per_bin: at most this many samples per pack (None: no cap).
        vision_capacity: at most this much vision cost per pack (None: no cap); see ``vision_cost``.
        vision_cost: what ``vision_capacity`` counts: ViT "patches" or "images".
        oversized: a sample longer than ``capacity``: "raise", "skip" (reported) or "truncate" (clipped and
            reported by ``pack`` and ``StreamPacker``; ``PackedWebDataset`` refuses it: it cannot cut a sample).
        pad_to_multiple_of: each sample is padded to this multiple (context parallelism: ``pad_multiple_for``)
            by the collator, and every planner packs it on that padded span (``packing.padded_lengths``), so a
            bin is one row.
    Streaming:
        shuffle_seed: shuffle shards and samples with this seed per epoch (None: keep the order).
        shuffle_buffer: samples held for shuffling (ignored without ``shuffle_seed``).
        on_error: a sample whose data cannot be read: "skip" (skipped, counted by reason, warned about, and
            reported; within the ``max_consecutive_failures`` budget) or "raise".
        exif_transpose: apply EXIF orientation, as ``ImageOps.exif_transpose`` and the forecast do.
        max_image_pixels: refuse an image whose header declares more pixels, before decoding, counted as
            ``image_too_large`` (default: Pillow's default limit, ``DEFAULT_MAX_IMAGE_PIXELS``; None: no cap).
        max_consecutive_failures: the failure budget (``vlm_pack.failures``): more bad samples than this in a
            row, in one stage (the forecast, or the processing of packed samples), raise
            ``FailureBudgetError`` instead of skipping on (None: no limit). An epoch in which no sample was
            good raises whatever this is.
        max_bad_fraction: the failure budget's share (``vlm_pack.failures``): more than this share of the
            samples a stage has seen being bad raises ``FailureBudgetError`` naming the most common reason and
            its fix, good samples between bad ones notwithstanding. Judged once the stage has seen
            ``vlm_pack.failures.MIN_SEEN_FOR_FRACTION`` (100) samples, after every sample and at the stage's
            end (fewer say nothing of the data). In [0, 1); None: no limit.
    """

    capacity: int
    buffer_size: int = 256
    min_fill_ratio: float = 0.95
    drop_last: bool = False
    max_samples_per_bin: int | None = None
    vision_capacity: int | None = None
    vision_cost: str = "patches"
    oversized: str = "raise"
    pad_to_multiple_of: int = 1
    shuffle_seed: int | None = None
    shuffle_buffer: int = 256
    on_error: str = "skip"
    exif_transpose: bool = True
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    max_consecutive_failures: int | None = DEFAULT_MAX_CONSECUTIVE_FAILURES
    max_bad_fraction: float | None = DEFAULT_MAX_BAD_FRACTION

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "capacity", _positive_int(self.capacity, "capacity"))
        set_(self, "buffer_size", _positive_int(self.buffer_size, "buffer_size"))
        ratio = self.min_fill_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"min_fill_ratio must be a float in (0, 1], got {ratio!r}")
        set_(self, "min_fill_ratio", float(ratio))
        set_(self, "drop_last", bool(self.drop_last))
        for name in ("max_samples_per_bin", "vision_capacity", "max_image_pixels", "max_consecutive_failures"):
            set_(self, name, _positive_int(getattr(self, name), name, optional=True))
        if self.vision_cost not in VISION_COST:
            raise ValueError(f"vision_cost must be one of {VISION_COST}, got {self.vision_cost!r}")
        check_choice("oversized", self.oversized, OVERSIZED)
        set_(self, "pad_to_multiple_of", _positive_int(self.pad_to_multiple_of, "pad_to_multiple_of"))
        if self.capacity % self.pad_to_multiple_of:
            raise ValueError(
                f"capacity {self.capacity} is not a multiple of pad_to_multiple_of {self.pad_to_multiple_of}: "
                f"use capacity={math.ceil(self.capacity / self.pad_to_multiple_of) * self.pad_to_multiple_of}"
            )
        if self.shuffle_seed is not None and (
            isinstance(self.shuffle_seed, bool) or not isinstance(self.shuffle_seed, numbers.Integral)
        ):
            raise ValueError(f"shuffle_seed must be an int or None, got {self.shuffle_seed!r}")
        set_(self, "shuffle_buffer", _positive_int(self.shuffle_buffer, "shuffle_buffer"))
        check_choice("on_error", self.on_error, ON_ERROR)
        set_(self, "exif_transpose", bool(self.exif_transpose))
        set_(self, "max_bad_fraction", check_fraction(self.max_bad_fraction))

    @property
    def fill_threshold(self) -> int:
        """Tokens at which a streaming bin is full enough to leave (``ceil(min_fill_ratio * capacity)``)."""
        # round() first so that 0.7 * 10 = 7.000000000000001 does not become 8
        return max(1, math.ceil(round(self.min_fill_ratio * self.capacity, 9)))

    @classmethod
    def resolve(
        cls, who: str, config: PackingConfig | int | None = None, *, refuse: tuple[str, ...] = (), **knobs: Any
    ) -> PackingConfig:
        """The config an entry point ``who`` runs with: ``config`` with ``knobs`` (its keyword arguments)
        applied over it, or one built from ``knobs`` alone; the same names, values and defaults either way.
        An int ``config`` is the capacity (``pack(lengths, 1024)``, ``StreamPacker(1024)``).

        ``refuse``: ``oversized`` values ``who`` cannot do (a dataset that cannot cut a sample refuses
        "truncate"); an old name (``max_samples_per_row``, ``seed`` ...) raises ``TypeError`` naming the new one.
        """
        check_layout(who, knobs)
        if isinstance(config, numbers.Integral) and not isinstance(config, bool):
            # pack(lengths, 1024) / StreamPacker(1024): the capacity in config's place
            if knobs.get("capacity") is not None:
                raise TypeError(f"{who}: capacity given twice ({config} and capacity={knobs['capacity']!r})")
            config, knobs = None, {**knobs, "capacity": int(config)}
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(knobs) - valid)
        if unknown:
            raise TypeError(f"{who}: unknown argument(s) {unknown}; packing settings: {sorted(valid)}")
        if config is None:
            if knobs.get("capacity") is None:
                raise TypeError(f"{who} needs capacity= (tokens per packed row) or config=PackingConfig(...)")
            config = cls(**knobs)
        else:
            if not isinstance(config, cls):
                raise TypeError(
                    f"{who}: config must be a PackingConfig (or the capacity, an int), got {config!r} "
                    f"({type(config).__name__})"
                )
            if knobs.get("capacity") is None:
                knobs.pop("capacity", None)
            config = config.replace(**knobs) if knobs else config
        if config.oversized in refuse:
            can = [v for v in OVERSIZED if v not in refuse]
            raise ValueError(
                f"{who} cannot do oversized={config.oversized!r} (it never cuts a sample): pass oversized="
                + " or ".join(repr(v) for v in can)
                + " (a too-long sample is reported as too_long), or pack offline with vlm_pack.pack"
            )
        return config

    def replace(self, **changes: Any) -> PackingConfig:
        """A copy with ``changes`` applied and validated; an unknown name lists the valid ones."""
        check_layout("PackingConfig.replace", changes)
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown packing option(s) {unknown}; valid: {sorted(self.to_dict())}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackingConfig:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown packing option(s) {unknown} in the saved config")
        return cls(**data)
