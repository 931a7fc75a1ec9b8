"""Analysis: :class:`LengthTable` -> per-capacity metrics, packed against the padded baseline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from vlm_pack._version import __version__
from vlm_pack.config import PackingConfig
from vlm_pack.data.forecast import LengthTable
from vlm_pack.packing import PackResult


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


def _grad_accum_metrics(
    b: Baseline, per_micro: float, micro_padded: int, micro_packed: int
) -> dict[str, Any]:
    """The padded run's updates and the packed run's two grad-accum choices (see :func:`_grad_accum`)."""
    target = b.samples_per_update
    best, reach = _grad_accum(target, per_micro)
    return {
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
            "grad_accum": best,  # samples per update closest to the target
            "samples_per_update": per_micro * best,
            "optimizer_steps_per_epoch": math.ceil(micro_packed / best) if best else 0,
            "min_grad_accum_reaching_target": reach,  # never fewer samples per update than the target
            "min_reaching_samples_per_update": per_micro * reach,
        },
    }


def _analysis_config(capacity: int, config: PackingConfig | None) -> PackingConfig:
    """``config`` at ``capacity``; when None, ``oversized="skip"`` and no caps: an analysis counts the samples
    too long for a capacity rather than stopping at the first (``"raise"`` in ``config`` stops)."""
    if config is None:
        return PackingConfig(capacity=int(capacity), oversized="skip")
    return config.replace(capacity=int(capacity))


def _pack_metrics(table: LengthTable, result: PackResult, vision_kept: np.ndarray) -> dict[str, Any]:
    """The packs' fill and what each pack holds; ``vision_kept`` ``[N]``: vision tokens each sample keeps."""
    from vlm_pack.data.plan import vision_inputs

    nb = result.num_bins
    starts = result.bin_offsets[:-1]
    seg = lambda v: np.add.reduceat(v[result.order], starts) if nb else np.zeros(0, np.int64)  # noqa: E731
    return {
        "bins": nb,
        "lower_bound": result.lower_bound,
        "efficiency": result.efficiency,
        "waste": 1.0 - result.efficiency if nb else 0.0,
        "padded_tokens": nb * int(result.capacity),
        "samples_per_pack": _stats(result.bin_sizes.astype(np.float64)),
        "images_per_pack": _stats(seg(table.num_images).astype(np.float64)),
        "vision_inputs_per_pack": _stats(seg(vision_inputs(table)).astype(np.float64)),  # images + videos
        "vision_tokens_per_pack": _stats(seg(vision_kept).astype(np.float64)),
    }


def step_balance(
    table: LengthTable,
    result: PackResult,
    world_size: int,
    grad_accum: int = 1,
    *,
    cost: Any = None,
    shuffle_seed: int = 0,
) -> dict[str, Any]:
    """How long ranks wait for each other in the plan ``PackedMapDataset`` would train on: the packs of
    ``result`` (made equal per rank as a plan does) dealt to ``world_size`` ranks, steps of ``grad_accum``
    micro-batches, each pack costed by ``cost`` (a :class:`~vlm_pack.packing.PackCost`, default Qwen2-VL-7B's,
    or a callable).

    Returns ``{"world_size", "grad_accum", "steps", "epoch_plan", "step_plan", "packs", "num_packs",
    "short_of_images"}``: ``epoch_plan`` / ``step_plan`` are the step imbalance (sum over steps of the slowest
    rank's cost / sum of the mean, :func:`~vlm_pack.packing.step_imbalance`) of ``EpochBalance()`` (each
    rank's epoch total balanced, steps in the order ``shuffle_seed`` gives epoch 0) and of the default step
    plan (``StepBalance()``: cost-balanced packs where they deal better, see
    :func:`~vlm_pack.data.plan.plan_packs`); ``packs``: which packs it keeps (``"balanced"`` or ``"bfd"``) and
    ``num_packs`` how many; ``short_of_images``: :func:`~vlm_pack.packing.steps.steps_short_of_images` of
    the step plan (a video counts as an image: it runs the vision tower): ``"short"`` counts every step where
    a rank has no image pack, ``"avoidable"`` those the
    plan's image packs could have filled (0: the image rule holds). A dataset too small for ``world_size`` ranks
    gives ``{"error": reason}`` instead."""
    from vlm_pack.data.plan import _costs_and_images, _split_for_ranks, deal_packs, plan_packs
    from vlm_pack.packing import EpochBalance, StepBalance, step_imbalance
    from vlm_pack.packing.steps import steps_short_of_images

    try:
        bins = _split_for_ranks([np.asarray(b, dtype=np.int64) for b in result.bins], world_size)
    except ValueError as e:
        return {"world_size": world_size, "grad_accum": grad_accum, "error": str(e)}
    members = np.concatenate(bins)
    ptr = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    lengths = np.asarray(result.lengths, dtype=np.int64)
    costs = _costs_and_images(table, lengths, members, ptr, cost)[0]
    epoch, _ = deal_packs(table, lengths, members, ptr, world_size, EpochBalance())
    epoch = epoch[:, np.random.default_rng([shuffle_seed, 0]).permutation(epoch.shape[1])]
    kept, kept_ptr, steps, _ = plan_packs(table, lengths, result, world_size, StepBalance(grad_accum, cost=cost))
    kept_costs, images = _costs_and_images(table, lengths, kept, kept_ptr, cost)
    return {
        "world_size": world_size,
        "grad_accum": grad_accum,
        "steps": -(-steps.shape[1] // grad_accum),
        "epoch_plan": step_imbalance(costs, epoch, grad_accum),
        "step_plan": step_imbalance(kept_costs, steps, grad_accum),
        "packs": "bfd" if kept_ptr.size == ptr.size and np.array_equal(kept, members) else "balanced",
        "num_packs": int(kept_ptr.size - 1),
        "short_of_images": steps_short_of_images(images > 0, steps, grad_accum),
    }


def analyze_capacity(
    table: LengthTable,
    capacity: int,
    *,
    config: PackingConfig | None = None,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    seed: int = 0,
    cost: Any = None,
) -> tuple[dict[str, Any], PackResult]:
    """Pack ``table`` at ``capacity`` with ``strategy`` and compare with the padded ``baseline``.

    ``config``: the packing knobs (:class:`vlm_pack.config.PackingConfig`: ``oversized``,
    ``max_samples_per_bin``, ``vision_capacity`` with ``vision_cost``); its ``capacity`` is replaced by
    ``capacity``. Default: ``oversized="skip"`` and no caps, e.g. at most 8 images a pack:
    ``config=PackingConfig(capacity, oversized="skip", vision_capacity=8, vision_cost="images")``.
    Samples longer than ``capacity`` are skipped (``oversized="skip"``) or counted at ``capacity``
    (``"truncate"``, as a padded run with ``max_length=capacity`` would cut them); both are reported;
    ``"raise"`` raises ``ValueError`` at the first.
    The padded baseline is the same at every capacity: a padded run has no capacity, so it batches every
    sample of ``table`` at its full length, in one fixed random order (``seed``). ``cost`` prices a pack for
    the step balance (``baseline.world_size`` > 1): a :class:`~vlm_pack.packing.PackCost`, default Qwen2-VL-7B's.
    Returns ``(metrics, PackResult)``.
    """
    config = _analysis_config(capacity, config)
    capacity = config.capacity
    lengths = table.lengths
    if lengths.size and lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"sample {table.keys[i]!r} has length 0: nothing to train on; drop it.")
    result = table.pack(config, strategy)
    kept = result.order
    kept_lens = result.lengths[kept]
    b = baseline
    padded = {
        order: padded_batches(lengths, b.batch_size, order=order, seed=seed)
        for order in ("random", "grouped")
    }
    n, nb = int(kept.size), result.num_bins
    mean_spp = n / nb if nb else 0.0
    per_micro = mean_spp * b.world_size * b.packs_per_device
    micro_padded = math.ceil(lengths.size / (b.batch_size * b.world_size))
    micro_packed = math.ceil(nb / (b.world_size * b.packs_per_device))
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
            **_pack_metrics(table, result, vision_kept),
            "micro_steps_per_epoch": micro_packed,
        },
        "grad_accum": _grad_accum_metrics(b, per_micro, micro_padded, micro_packed),
    }
    if b.world_size > 1 and nb:
        metrics["step_balance"] = step_balance(table, result, b.world_size, b.grad_accum, cost=cost)
    return metrics, result


def analyze(
    table: LengthTable,
    capacities: Sequence[int],
    *,
    config: PackingConfig | None = None,
    baseline: Baseline = Baseline(),
    strategy: str = "bfd",
    seed: int = 0,
    meta: dict[str, Any] | None = None,
    cost: Any = None,
) -> tuple[dict[str, Any], list[PackResult]]:
    """:func:`analyze_capacity` for each capacity, plus dataset statistics: ``(report, pack results)``.

    ``config``: the packing knobs, as for :func:`analyze_capacity` (its capacity is replaced by each of
    ``capacities``). ``meta`` is copied into the report's top level (where the data came from). ``cost``:
    what a pack costs a rank for the step balance (``baseline.world_size`` > 1; a
    :class:`~vlm_pack.packing.PackCost`, default Qwen2-VL-7B's, e.g. ``PackCost.from_config(model_config)``).
    """
    if not capacities:
        raise ValueError("give at least one capacity")
    if len(table) == 0:
        raise ValueError("no samples to analyze: the sources are empty (or every sample was invalid)")
    config = _analysis_config(capacities[0], config)
    per_cap, results = [], []
    for cap in capacities:
        m, r = analyze_capacity(
            table, int(cap), baseline=baseline, strategy=strategy, seed=seed, config=config, cost=cost
        )
        per_cap.append(m)
        results.append(r)
    n_img = table.num_images
    n_vid = table.num_videos if table.num_videos is not None else np.zeros_like(n_img)
    video_tokens = table.video_tokens if table.video_tokens is not None else np.zeros_like(n_img)
    report = {
        "vlm_pack_version": __version__,
        **(meta or {}),
        "baseline": asdict(baseline) | {"samples_per_update": baseline.samples_per_update},
        "dataset": {
            "samples": len(table),
            "images": int(n_img.sum()),
            "videos": int(n_vid.sum()),
            "text_only_samples": int(((n_img == 0) & (n_vid == 0)).sum()),
            "images_per_sample": {str(k): int(v) for k, v in zip(*np.unique(n_img, return_counts=True))},
            "text_tokens": int(table.text_tokens.sum()),
            "vision_tokens": int(table.vision_tokens.sum()),
            "text_tokens_per_sample": _stats(table.text_tokens.astype(np.float64)),
            "vision_tokens_per_sample": _stats(table.vision_tokens.astype(np.float64)),
            "video_tokens": int(video_tokens.sum()),
            "video_tokens_per_sample": _stats(video_tokens.astype(np.float64)),
            "length_per_sample": _stats(table.lengths.astype(np.float64)),
            "invalid": [{"key": k, "source": s, "reason": r} for k, s, r in table.invalid],
        },
        "capacities": per_cap,
    }
    return report, results
