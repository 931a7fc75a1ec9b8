"""Output of an analysis: the plain-text table, ``report.json`` / ``report.txt`` and the plots' files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vlm_pack.config import PackingConfig
from vlm_pack.data.forecast import LengthTable
from vlm_pack.packing import PackResult

from .analysis import Baseline
from .plots import _pyplot, plot_efficiency, plot_lengths, plot_packs

_Row = tuple[str, Callable[[dict[str, Any]], str]]  # (label, one capacity's report -> its cell)


def _n(x: float) -> str:
    # Exact below 100k (capacities, per-pack counts stay comparable digit for digit), k / M / G above.
    x = float(x)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e5)):
        if abs(x) >= scale:
            scale = 1e3 if unit == "k" else scale
            return f"{x / scale:.1f}{unit}"
    return f"{x:,.0f}"


def _dataset_lines(report: dict[str, Any]) -> list[str]:
    """The lines above the table: the dataset's token statistics and the padded baseline."""
    d, b = report["dataset"], report["baseline"]
    t, v, L = d["text_tokens_per_sample"], d["vision_tokens_per_sample"], d["length_per_sample"]
    lines = [
        f"vlm-pack analyze: {d['samples']:,} samples ({d['images']:,} images, "
        + (f"{d['videos']:,} videos, " if d.get("videos") else "")
        + f"{d['text_only_samples']:,} text-only)"
        + (f" | {report['family']}" if report.get("family") else "")
        + (f" | {report['source']}" if report.get("source") else ""),
        f"tokens per sample   text   mean {t['mean']:>7,.0f}  p50 {t['p50']:>7,.0f}  p95 {t['p95']:>7,.0f}  max {t['max']:>7,.0f}",
        f"                    vision mean {v['mean']:>7,.0f}  p50 {v['p50']:>7,.0f}  p95 {v['p95']:>7,.0f}  max {v['max']:>7,.0f}",
        f"                    total  mean {L['mean']:>7,.0f}  p50 {L['p50']:>7,.0f}  p95 {L['p95']:>7,.0f}  max {L['max']:>7,.0f}",
    ]
    if d.get("videos"):  # images are `vision`; a video's tokens are their own row (and in `total`)
        w = d["video_tokens_per_sample"]
        lines.insert(3, f"                    video  mean {w['mean']:>7,.0f}  p50 {w['p50']:>7,.0f}  p95 {w['p95']:>7,.0f}  max {w['max']:>7,.0f}")
    if d["invalid"]:
        lines.append(f"invalid samples skipped: {len(d['invalid'])} (listed in report.json)")
    lines.append(
        f"padded baseline: {b['batch_size']} samples/device x {b['world_size']} device(s) x grad-accum "
        f"{b['grad_accum']}; target {b['samples_per_update']} samples per optimizer update"
    )
    return lines


def _table_lines(caps: list[dict[str, Any]], rows: list[_Row]) -> list[str]:
    """One column per capacity: a header, a rule, then one line per ``(label, format)`` row."""
    head = ["capacity"] + [f"{c['capacity']:,}" for c in caps]
    body = [[label] + [fmt(c) for c in caps] for label, fmt in rows]
    w0 = max(len(r[0]) for r in [head, *body])
    ws = [max(len(r[i]) for r in [head, *body]) for i in range(1, len(head))]
    fmt_row = lambda r: "  ".join([r[0].ljust(w0)] + [x.rjust(w) for x, w in zip(r[1:], ws)])  # noqa: E731
    return [fmt_row(head), "-" * (w0 + sum(w + 2 for w in ws)), *(fmt_row(r) for r in body)]


def _step_balance_cell(c: dict[str, Any]) -> str:
    sb = c.get("step_balance")
    if sb is None:
        return "-"
    if "error" in sb:
        return "too few packs"
    short = sb.get("short_of_images", {}).get("short", 0)
    lacking = f", {short} step(s) a rank lacks an image" if short else ""
    star = "*" if sb.get("packs") == "balanced" else ""
    return f"{sb['epoch_plan']:.3f} -> {sb['step_plan']:.3f}{lacking}{star}"


def _sample_rows() -> list[_Row]:
    """What each capacity packed, left out and computed."""
    return [
        ("samples packed", lambda c: f"{c['packed_samples']:,}"),
        ("  oversized, skipped", lambda c: f"{len(c['oversized_skipped']):,}"),
        ("  truncated to capacity", lambda c: f"{len(c['truncated']):,}"),
        ("tokens text + vision", lambda c: f"{_n(c['text_tokens'])} + {_n(c['vision_tokens'])}"),
    ]


def _padded_rows() -> list[_Row]:
    """The padded baseline (no capacity: the same in every column)."""
    return [
        ("PADDED (same at every capacity)", lambda c: ""),
        ("  micro-batches", lambda c: f"{c['padded']['random']['batches']:,}"),
        ("  padding waste, random order", lambda c: f"{c['padded']['random']['waste']:.1%}"),
        ("  padding waste, length-grouped", lambda c: f"{c['padded']['grouped']['waste']:.1%}"),
        ("  tokens computed (random)", lambda c: _n(c["padded"]["random"]["padded_tokens"])),
        ("  largest micro-batch, tokens", lambda c: _n(c["padded"]["random"]["max_batch_tokens"])),
    ]


def _packed_rows(packs_per_device: int) -> list[_Row]:
    """The packs of each capacity; a packed micro-batch holds ``packs_per_device`` full packs at most."""
    return [
        ("PACKED: packs", lambda c: f"{c['packed']['bins']:,} (>= {c['packed']['lower_bound']:,})"),
        ("  efficiency", lambda c: f"{c['packed']['efficiency']:.1%}"),
        ("  padding waste", lambda c: f"{c['packed']['waste']:.1%}"),
        ("  tokens computed", lambda c: _n(c["packed"]["padded_tokens"])),
        ("  largest micro-batch, tokens", lambda c: _n(c["capacity"] * packs_per_device)),
        (
            "  samples/pack mean p50 p95",
            lambda c: "{mean:.2f} {p50:.0f} {p95:.0f}".format(**c["packed"]["samples_per_pack"]),
        ),
        ("  images/pack mean max", lambda c: "{mean:.2f} {max:.0f}".format(**c["packed"]["images_per_pack"])),
        (
            "  vision tokens/pack mean max",
            lambda c: "{} {}".format(
                _n(c["packed"]["vision_tokens_per_pack"]["mean"]),
                _n(c["packed"]["vision_tokens_per_pack"]["max"]),
            ),
        ),
    ]


def _grad_accum_rows() -> list[_Row]:
    """Gradient accumulation packed vs padded: steps per update and per epoch."""
    return [
        (
            "GRAD ACCUM packed, recommended (1)",
            lambda c: (
                f"{c['grad_accum']['packed']['grad_accum']} ({c['grad_accum']['packed']['samples_per_update']:.1f})"
            ),
        ),
        (
            "  smallest reaching target (2)",
            lambda c: (
                f"{c['grad_accum']['packed']['min_grad_accum_reaching_target']} "
                f"({c['grad_accum']['packed']['min_reaching_samples_per_update']:.1f})"
            ),
        ),
        (
            "  optimizer steps/epoch pad->pack",
            lambda c: (
                f"{c['grad_accum']['padded']['optimizer_steps_per_epoch']:,} -> "
                f"{c['grad_accum']['packed']['optimizer_steps_per_epoch']:,}"
            ),
        ),
        (
            "  micro steps/epoch pad->pack",
            lambda c: (
                f"{c['padded']['random']['micro_steps_per_epoch']:,} -> {c['packed']['micro_steps_per_epoch']:,}"
            ),
        ),
    ]


def _report_rows(report: dict[str, Any]) -> list[_Row]:
    """Every row of the table, the step-imbalance rows only when some capacity has them."""
    rows = [*_sample_rows(), *_padded_rows(), *_packed_rows(report["baseline"]["packs_per_device"])]
    rows += _grad_accum_rows()
    if any("step_balance" in c for c in report["capacities"]):
        rows += [
            ("STEP IMBALANCE (slowest / mean)", lambda c: ""),
            ("  epoch-balanced -> step plan", _step_balance_cell),
        ]
    return rows


def _footnotes(report: dict[str, Any]) -> list[str]:
    """The lines below the table: what the grad-accum rows and (when present) the step imbalance mean."""
    target = report["baseline"]["samples_per_update"]
    lines = [
        f"grad-accum rows: micro steps per optimizer update (samples per update); target {target} samples.",
        f"  (1) recommended: samples per update closest to {target}.",
        f"  (2) the fewest steps that never give fewer than {target} samples per update.",
        "padded columns repeat: a padded run has no capacity (every sample at full length, one random order).",
    ]
    sb = next((c["step_balance"] for c in report["capacities"] if "step_balance" in c), None)
    if sb is not None:
        lines.append(
            f"step imbalance: sum over steps of the slowest rank's cost / the mean's, {sb['world_size']} ranks x "
            f"grad-accum {sb['grad_accum']}; PackedMapDataset trains on the step plan (balance=StepBalance());"
            " * its packs made for the steps (cost-balanced), where they deal better than the best-fit ones."
        )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table: one column per capacity."""
    table = _table_lines(report["capacities"], _report_rows(report))
    return "\n".join([*_dataset_lines(report), "", *table, "", *_footnotes(report)])


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_report(
    out_dir: str | os.PathLike[str],
    report: dict[str, Any],
    table: LengthTable,
    results: Sequence[PackResult],
    *,
    baseline: Baseline | None = None,
    strategy: str = "bfd",
    plots: bool = True,
    config: PackingConfig | None = None,
) -> list[Path]:
    """Write ``report.json``, ``report.txt`` and (with matplotlib) ``lengths.png``, ``efficiency.png`` and
    ``packs.png`` (a few packs of every capacity that packed any sample) into ``out_dir``; return the paths.

    Raises ``ValueError`` naming ``out_dir`` when it cannot be created or written.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"report folder {str(out)!r} cannot be created: {e.strerror or e}.") from None
    written = []
    caps = [c["capacity"] for c in report["capacities"]]
    if plots:
        try:
            _pyplot()
        except ImportError:
            plots = False
            report = {**report, "plots_skipped": "matplotlib is not installed: pip install 'vlm-pack[plot]'"}
    if plots:
        plot_lengths(table, caps, out / "lengths.png")
        plot_efficiency(
            table, caps, baseline=baseline, strategy=strategy, path=out / "efficiency.png", config=config
        )
        written += [out / "lengths.png", out / "efficiency.png"]
        if any(r.num_bins for r in results):  # one panel per capacity that packed anything
            plot_packs(table, results, path=out / "packs.png")
            written.append(out / "packs.png")
        report = {**report, "plots": [p.name for p in written]}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    (out / "report.txt").write_text(format_report(report) + "\n")
    return [out / "report.json", out / "report.txt", *written]
