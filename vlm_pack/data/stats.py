"""What the streaming pipeline counts: samples read, packed, skipped (by reason), time per phase.

``PipelineStats`` is kept per stream in the DataLoader workers, travels to the main process with each
batch's snapshot, and is summed there (``merge``). Its field list is written once, in the dataclass:
``to_dict`` / ``from_dict`` / ``merge`` derive from ``dataclasses.fields``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..failures import BAD_REASONS, example

__all__ = ["BAD_REASONS", "OWN_PHASES", "PHASES", "BadSample", "BadSampleWarning", "PipelineStats"]

# Fields added after state version 2: a saved state may lack them (their default then).
_ADDED_FIELDS = ("first_bad",)

#: Phases timed in :attr:`PipelineStats.time`: CPU seconds of the stream's thread (``time.thread_time``, so
#: other processes on the machine do not inflate them), summed over streams. ``OWN_PHASES`` are vlm-pack's;
#: ``read`` is tar reading (I/O waits excluded), ``preprocess`` image decode + HF image processor + tokenizer.
PHASES = ("read", "forecast", "pack", "preprocess", "collate", "state")
OWN_PHASES = ("forecast", "pack", "collate", "state")

#: Bad samples kept as examples in a sum of stats (``reasons`` counts all of them).
MAX_BAD_IN_SUM = 1000


#: Reasons counted per shard, not per sample.
SHARD_REASONS = ("unreadable_shard", "empty_shard")


class BadSampleWarning(UserWarning):
    """A sample or shard was skipped; the message names the shard, the key and the reason."""


@dataclass(frozen=True)
class BadSample:
    """One skipped sample: ``shard`` (URL), ``key`` (WebDataset key; the last good key for a shard error)."""

    shard: str
    key: str | None
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: shard {self.shard}, key {self.key!r}: {self.detail}"

    @property
    def example(self) -> str:
        """How a failure budget's error quotes this sample (``vlm_pack.failures.example``)."""
        return example(f"key {self.key!r} in {self.shard}", self.detail)


@dataclass
class PipelineStats:
    """Counters of the pipeline (per stream in workers, summed in the main process).

    ``samples_read == samples_packed + samples_bad + samples_dropped + samples held in buffers``; at the
    end of an epoch no sample is held. ``bad`` keeps the most recent ``max_examples`` bad samples per
    stream (1000 in a sum); ``reasons`` counts all of them. ``time`` holds CPU seconds per phase (``PHASES``).
    """

    capacity: int = 0
    """Tokens per pack; the denominator of :attr:`fill_ratio`."""
    samples_read: int = 0
    """Samples read from the shards, bad ones included (a re-dealt buffered sample counts once)."""
    samples_packed: int = 0
    """Samples in the yielded batches."""
    samples_bad: int = 0
    """Samples skipped as bad (unreadable, invalid, too large, a forecast overflowing its pack, ...)."""
    samples_dropped: int = 0
    """Samples of the underfilled packs ``drop_last`` dropped at the end of a stream."""
    bins: int = 0
    """Packs yielded, one per batch."""
    tokens: int = 0
    """Tokens of the packed samples as processed, padding not counted."""
    forecast_mismatches: int = 0
    """Samples whose processed length differed from the forecast (each one warned about)."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Bad samples and unreadable shards per ``BadSample.reason``."""
    bad: list[BadSample] = field(default_factory=list)
    """The most recent bad samples, as examples."""
    first_bad: dict[str, BadSample] = field(default_factory=dict)
    """The first bad sample of each reason (every reason keeps an example, however many came after)."""
    time: dict[str, float] = field(default_factory=dict)
    """CPU seconds per phase (``PHASES``)."""

    @property
    def fill_ratio(self) -> float:
        """Real tokens / (bins * capacity) over the yielded batches."""
        return self.tokens / (self.bins * self.capacity) if self.bins and self.capacity else 0.0

    @property
    def own_time_share(self) -> float:
        """Share of the timed work spent in vlm-pack's own phases (forecast, pack, collate, state)."""
        total = sum(self.time.values())
        return sum(self.time.get(p, 0.0) for p in OWN_PHASES) / total if total else 0.0

    def count_bad(self, bad: BadSample, max_examples: int) -> None:
        """Count ``bad`` under its reason (a shard error is not a sample) and keep it as an example."""
        if bad.reason not in SHARD_REASONS:
            self.samples_bad += 1
        self.reasons[bad.reason] = self.reasons.get(bad.reason, 0) + 1
        self.first_bad.setdefault(bad.reason, bad)
        self.bad.append(bad)
        del self.bad[:-max_examples]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; ``bad`` as ``{"shard", "key", "reason", "detail"}`` dicts."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["reasons"], out["time"] = dict(self.reasons), dict(self.time)
        out["bad"] = [dataclasses.asdict(b) for b in self.bad]
        out["first_bad"] = {reason: dataclasses.asdict(b) for reason, b in self.first_bad.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineStats:
        """Inverse of :meth:`to_dict`; also reads the ``[shard, key, reason, detail]`` lists of state version 1."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in _ADDED_FIELDS and f.name not in data:
                continue
            value = data[f.name]
            if f.name == "first_bad":
                value = {reason: BadSample(**b) for reason, b in value.items()}
            elif f.name == "reasons":
                value = {k: int(v) for k, v in value.items()}
            elif f.name == "time":
                value = {k: float(v) for k, v in value.items()}
            elif f.name == "bad":
                value = [BadSample(**b) if isinstance(b, dict) else BadSample(*b) for b in value]
            else:
                value = int(value)
            values[f.name] = value
        return cls(**values)

    def merge(self, other: PipelineStats) -> PipelineStats:
        """A new stats object with both counts added (``capacity``: the first one set)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "capacity":
                values[f.name] = mine or theirs
            elif f.name == "first_bad":
                values[f.name] = {**theirs, **mine}  # the first sum's example wins
            elif isinstance(mine, dict):
                values[f.name] = {k: mine.get(k, 0) + theirs.get(k, 0) for k in {**mine, **theirs}}
            elif isinstance(mine, list):
                values[f.name] = (mine + theirs)[-MAX_BAD_IN_SUM:]
            else:
                values[f.name] = mine + theirs
        return PipelineStats(**values)

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items())) or "none"
        return (
            f"{self.samples_read} samples read, {self.samples_packed} packed into {self.bins} bins "
            f"(fill {self.fill_ratio:.3f}), {self.samples_bad} bad ({reasons}), "
            f"{self.samples_dropped} dropped (drop_last), {self.forecast_mismatches} forecast mismatches"
        )
