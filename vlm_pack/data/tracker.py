"""The main process's record of a streaming epoch: each stream's last delivered batch, and the resume state.

:class:`StreamTracker` is the one owner of a :class:`~vlm_pack.data.PackedWebDataset`'s progress. The
dataset hands it the metadata of every batch the consumer received (``observe``); the tracker keeps the
latest :class:`~vlm_pack.data.state.StreamSnapshot` per stream, follows epochs and layout changes, sums the
streams' counters (``stats``), and saves / loads :class:`~vlm_pack.data.state.PipelineState` (``state_dict``
/ ``load_state_dict``, JSON format unchanged). It is pickled to the DataLoader workers with the dataset,
where :meth:`StreamTracker.resolve` tells each stream which plan items and snapshot it starts from.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from ..failures import no_good_sample
from .state import EpochProgress, PipelineState, fresh_plan, remaining_plan
from .stats import SHARD_REASONS, PipelineStats

__all__ = ["StreamTracker"]


class StreamTracker:
    """Progress of a streaming pipeline over ``urls``, observed from the batches its streams yield.

    Args:
        urls: the shard list (saved as a digest: a state resumes only over the same list, same order).
        shuffle_seed: shard order per epoch (``None``: the list's order).
        shuffle_buffer: samples in each stream's shuffle buffer (0: none).
        packer: the ``StreamPacker`` keyword arguments; with the seed and buffer, what a state must match.
        capacity: tokens per pack (the denominator of ``stats.fill_ratio``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        shuffle_seed: int | None,
        shuffle_buffer: int,
        packer: dict[str, Any],
        capacity: int,
    ) -> None:
        self.num_urls = len(urls)
        self.urls_digest = hashlib.sha1("\n".join(urls).encode()).hexdigest()
        self.shuffle_seed = shuffle_seed
        self.shuffle_buffer = int(shuffle_buffer)
        self.packer = dict(packer)
        self.capacity = int(capacity)
        self.progress = EpochProgress(epoch=0)
        self.totals = PipelineStats(capacity=self.capacity)  # earlier epochs

    # -- epochs and counters
    @property
    def epoch(self) -> int:
        return self.progress.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (keeps the progress if it is the current one)."""
        if int(epoch) != self.progress.epoch:
            self._fold()
            self.progress = EpochProgress(epoch=int(epoch))

    def _fold(self) -> None:
        self.totals = self.totals.merge(self.epoch_stats(self.progress))

    def epoch_stats(self, progress: EpochProgress | None = None) -> PipelineStats:
        """The counters of one epoch's progress (default: the current one), summed over its streams."""
        progress = self.progress if progress is None else progress
        stats = PipelineStats(capacity=self.capacity)
        if progress.base is not None:
            stats = stats.merge(progress.base)
        for stream in sorted(progress.streams):
            stats = stats.merge(progress.streams[stream].stats)
        return stats

    @property
    def stats(self) -> PipelineStats:
        """Counters over every observed batch (all epochs), summed over streams."""
        return self.totals.merge(self.epoch_stats())

    # -- resume state
    def state(self) -> PipelineState:
        return PipelineState(
            urls_digest=self.urls_digest,
            num_urls=self.num_urls,
            shuffle_seed=self.shuffle_seed,
            shuffle_buffer=self.shuffle_buffer,
            packer=dict(self.packer),
            progress=self.progress,
            totals=self.totals,
        )

    def state_dict(self) -> dict[str, Any]:
        """The state after the last observed batch as JSON data (``PipelineState.to_json``)."""
        return self.state().to_json()

    def _check_compatible(self, saved: PipelineState) -> None:
        if saved.urls_digest != self.urls_digest:
            raise ValueError(
                f"the state was saved for another shard list ({saved.num_urls} URLs, digest "
                f"{saved.urls_digest[:12]}); build the pipeline with the same URLs, in the same order."
            )
        mine = self.state()
        diff = {
            name: (getattr(saved, name), getattr(mine, name))
            for name in ("shuffle_seed", "shuffle_buffer", "packer")
            if getattr(saved, name) != getattr(mine, name)
        }
        if diff:
            raise ValueError(f"the state was saved with another configuration (saved, current): {diff}")

    def _merged_stats(self, values: list[PipelineStats | None]) -> PipelineStats | None:
        # Ranks that resumed from one merged state carry the same counts: count them once.
        present = [v for v in values if v is not None]
        if not present:
            return None
        if all(v == present[0] for v in present):
            return present[0]
        out = PipelineStats(capacity=self.capacity)
        for value in present:
            out = out.merge(value)
        return out

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (or a list of every rank's state dicts, merged); see
        ``PackedWebDataset.load_state_dict``."""
        raw = [state] if isinstance(state, dict) else list(state)
        if not raw:
            raise ValueError("load_state_dict: empty list of states")
        states = [PipelineState.from_json(s) for s in raw]
        for saved in states:
            self._check_compatible(saved)
        # A rank that had not started iterating saved an untouched epoch: it adds no stream and no count,
        # but its share of the epoch is still to do.
        started = [s for s in states if s.progress.layout is not None] or states[:1]
        if any(s.progress.epoch != started[0].progress.epoch for s in states):
            raise ValueError("load_state_dict: the states are from different epochs")
        self.progress = self._merged_progress([s.progress for s in started])
        self.progress.complete = all(s.progress.complete for s in states)
        totals = self._merged_stats([s.totals for s in started])
        self.totals = totals if totals is not None else PipelineStats(capacity=self.capacity)

    def _merged_progress(self, saved: list[EpochProgress]) -> EpochProgress:
        """One progress from every rank's (same epoch, generation and layout)."""
        first = saved[0]
        for other in saved[1:]:
            if (other.generation, other.layout) != (first.generation, first.layout):
                raise ValueError("load_state_dict: the states are from different layouts (world x workers)")
        progress = copy.deepcopy(first)
        progress.streams = {}
        for one in saved:  # a rank's state may hold another rank's streams, as it loaded them: latest wins
            for stream, snapshot in one.streams.items():
                if stream not in progress.streams or progress.streams[stream].seq < snapshot.seq:
                    progress.streams[stream] = snapshot
            progress.last_stream.update(one.last_stream)
        progress.base = self._merged_stats([one.base for one in saved])
        return progress

    # -- iterations
    def resolve(self, layout: tuple[int, int]) -> tuple[EpochProgress, bool]:
        """The progress an iteration with ``layout`` (world size, workers) starts from, and whether it
        resumes streams exactly (same layout, snapshots to continue from). Changes nothing.

        A pure function of the recorded progress, so workers and the main process agree.
        """
        resolved = copy.deepcopy(self.progress)
        if resolved.complete:
            resolved = EpochProgress(epoch=resolved.epoch + 1)
        if resolved.plan is None:
            resolved.plan = fresh_plan(self.num_urls, self.shuffle_seed, resolved.epoch)
        if resolved.layout is not None and resolved.layout != layout:
            base = self.epoch_stats(resolved)
            resolved.plan = remaining_plan(resolved)
            resolved.generation += 1
            resolved.streams, resolved.last_stream, resolved.base = {}, {}, base
        resolved.layout = layout
        return resolved, bool(resolved.streams)

    def begin(self, layout: tuple[int, int]) -> None:
        """Move to the iteration about to start with ``layout``, as its workers will (so a rank whose
        streams get no work after a re-deal still records the new layout)."""
        if self.progress.complete:
            self._fold()
        self.progress, _ = self.resolve(layout)

    def observe(self, meta: dict[str, Any]) -> bool:
        """Record a delivered item's stream metadata (``stream_info``); False if it changed nothing (a
        stale or repeated item). Idempotent.

        Raises:
            ValueError: an item that does not follow the state; or, when this completes the epoch, an
                epoch in which no shard could be opened.
            FailureBudgetError: when this completes an epoch in which no sample was good.
        """
        progress = self._follow(meta)
        if progress is None:
            return False
        snapshot = meta["snapshot"]
        stream = snapshot.stream
        old = progress.streams.get(stream)
        if old is not None and old.seq >= snapshot.seq:
            return False
        world = progress.layout[0]  # type: ignore[index]
        progress.streams[stream] = snapshot
        progress.last_stream[stream % world] = stream
        n_streams = progress.n_streams
        # this rank's streams with work (another rank's tracker follows the others)
        assert progress.plan is not None
        with_work = [s for s in range(stream % world, n_streams, world) if progress.plan[s::n_streams]]
        was_complete = progress.complete
        progress.complete = all(s in progress.streams and progress.streams[s].done for s in with_work)
        if progress.complete and not was_complete:
            self._check_read_something()
        return True

    def _follow(self, meta: dict[str, Any]) -> EpochProgress | None:
        """The progress ``meta`` belongs to (moving on to it if it starts the next epoch or generation);
        None for a stale item of a finished epoch."""
        progress = self.progress
        layout = tuple(meta["layout"])
        if (meta["epoch"], meta["generation"], layout) == (progress.epoch, progress.generation, progress.layout):
            return progress
        if progress.complete and meta["epoch"] == progress.epoch:
            return None
        resolved, _ = self.resolve(layout)  # type: ignore[arg-type]
        if (meta["epoch"], meta["generation"]) != (resolved.epoch, resolved.generation):
            raise ValueError(
                f"observe(): batch of epoch {meta['epoch']} (generation {meta['generation']}) does not follow "
                f"the state (epoch {progress.epoch}); call set_epoch() / load_state_dict() before iterating."
            )
        if progress.complete:
            self._fold()
        self.progress = resolved
        return resolved

    def mark_complete(self) -> None:
        """The consumer exhausted the iteration: the epoch is complete (checked as in :meth:`observe`)."""
        was_complete = self.progress.complete
        self.progress.complete = True
        if not was_complete:
            self._check_read_something()

    def _check_read_something(self) -> None:
        """Refuse an epoch that read no sample because every shard failed to open (a mistyped path), or in
        which no sample was good (every one skipped as bad data: ``vlm_pack.failures``)."""
        stats = self.epoch_stats()
        failed = [bad for bad in stats.bad if bad.reason == "unreadable_shard"]
        if stats.samples_bad and not stats.samples_packed and not stats.samples_dropped:
            counts = {r: n for r, n in stats.reasons.items() if r not in SHARD_REASONS}
            examples = {r: b.example for r, b in stats.first_bad.items()}
            raise no_good_sample(f"PackedWebDataset epoch {self.epoch}", counts, examples)
        if stats.samples_read or not failed:
            return
        shown = "; ".join(f"{bad.shard} ({bad.detail})" for bad in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        raise ValueError(
            f"PackedWebDataset: none of the {stats.reasons['unreadable_shard']} shard(s) this epoch could be "
            f"read, so it yields no batch: {shown}{more}. Check the paths (a brace pattern such as "
            "'data/shard-{000000..000099}.tar' must match existing files; relative paths are relative to "
            f"{os.getcwd()}) and that the files are tar archives."
        )
