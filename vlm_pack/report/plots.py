"""Plots of an analysis: lengths, efficiency against capacity, a few packs per capacity (matplotlib)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vlm_pack.config import PackingConfig
from vlm_pack.data.forecast import LengthTable
from vlm_pack.packing import PackResult

from .analysis import Baseline, analyze_capacity


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
    baseline: Baseline | None = None,
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
    baseline = baseline if baseline is not None else Baseline()
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
