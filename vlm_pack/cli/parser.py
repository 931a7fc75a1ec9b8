"""The ``vlm-pack`` command line's flags: argument types, flag groups and the parser (``cli/main.py`` runs it).

One flag group per concern (model, data, engine, packing, the padded baseline, output), shared by the
subcommands that need it; packing flags carry :class:`~vlm_pack.config.PackingConfig`'s names and defaults.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vlm_pack.config import ON_ERROR, OVERSIZED, VISION_COST, PackingConfig
from vlm_pack.failures import MIN_SEEN_FOR_FRACTION
from vlm_pack.families import DEFAULT_FAMILY, canonical, names

__all__ = ["build_parser"]

# The defaults of every setting a flag shares with PackingConfig: its own (capacity aside).
_DEFAULTS = PackingConfig(capacity=1)

_SOURCES_HELP = (
    "WebDataset .tar shards (globs, {000..009}), .parquet files (HF Image columns), .json (LLaVA-Instruct, "
    "ShareGPT, LLaMA-Factory) and .jsonl files, save_to_disk folders, or folders of these"
)


def _budget(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _positive_int(text)


def _fraction(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) (0.1: one in ten) or 'none', got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _family_name(text: str) -> str:
    # QWEN2_VL, qwen2-vl and qwen2vl name one family: the normaliser every entry point uses
    try:
        return str(canonical(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _add_forecast_args(p: argparse.ArgumentParser) -> None:
    """The flags that say what a sample's length is (the model) and how the records are read (the data)."""
    _add_model_args(p)
    _add_data_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (what a sample's length is)")
    g.add_argument(
        "--family",
        type=_family_name,
        help="VLM family: its chat format and its released checkpoint's image rules "
        f"({', '.join(names('chat_format'))}; any case). Default {DEFAULT_FAMILY}, or the one --processor "
        "names.",
    )
    g.add_argument(
        "--processor",
        metavar="DIR",
        help="a local Hugging Face checkpoint / processor folder (any family): its chat template, tokenizer and "
        "image processor give exact counts (no download).",
    )
    g.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder (default: --processor's)")
    g.add_argument("--max-pixels", type=_positive_int, help="Qwen families: cap on resized pixels per image")
    g.add_argument(
        "--min-pixels", type=_positive_int, help="Qwen families: floor on resized pixels per image"
    )
    g.add_argument(
        "--spec",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a vision-spec parameter (e.g. max_num_tiles=6); repeatable; an unknown KEY lists the "
        "valid ones",
    )
    g.add_argument(
        "--no-exif-transpose",
        action="store_true",
        help="your loader feeds PIL.Image.open results untransposed (WebDataset's PIL decoder): size images as "
        "stored, ignoring their EXIF orientation",
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument(
        "--image-root",
        metavar="DIR",
        help="The folder that the image paths in JSONL manifests are relative to (and in JSON, parquet and "
        "dataset records; default: each file's own folder). LLaVA-Instruct: its image folder.",
    )
    d.add_argument(
        "--format",
        dest="record_format",
        choices=("webdataset", "llava", "sharegpt", "messages", "caption"),
        help="the records' format (default: detected per record): llava {id, image, conversations: "
        "[{from, value}]}; sharegpt {messages | conversations, images}; messages {messages | conversation "
        "with content parts, images}; caption {caption | text, image(s)}",
    )
    d.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="processes reading and forecasting the data (default 1; with --engine ray: Ray workers, default "
        "every CPU of the cluster)",
    )
    d.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default=_DEFAULTS.on_error,
        help="a sample that cannot be read or forecast: skip it and list it in the report (default; more "
        "than --max-consecutive-failures in a row, or more than --max-bad-fraction of those read, stop the "
        "run), or raise: stop at the first",
    )
    d.add_argument(
        "--max-consecutive-failures",
        type=_budget,
        default=_DEFAULTS.max_consecutive_failures,
        metavar="N",
        help=f"the failure budget: more unreadable samples than N in a row stop the run (default "
        f"{_DEFAULTS.max_consecutive_failures}; 'none': no limit)",
    )
    d.add_argument(
        "--max-bad-fraction",
        type=_fraction,
        default=_DEFAULTS.max_bad_fraction,
        metavar="F",
        help=f"the failure budget's share: more unreadable samples than this share of those read (judged from "
        f"the {MIN_SEEN_FOR_FRACTION}th on) stop the run, exit status 1, the most common reason and its fix "
        f"last (default {_DEFAULTS.max_bad_fraction}; 'none': no limit)",
    )
    d.add_argument(
        "--max-image-pixels",
        type=_budget,
        default=_DEFAULTS.max_image_pixels,
        metavar="N",
        help="refuse an image whose header declares more pixels than N, before decoding it (a decompression "
        f"bomb, an oversized scan), listed as image_too_large (default {_DEFAULTS.max_image_pixels:,}, "
        "Pillow's own limit; 'none': no cap)",
    )
    d.add_argument(
        "--verify",
        action="store_true",
        help="decode every image's pixels too. Without it the check is header-only: the text parses, each "
        "placeholder has an image, and each image header gives a format and a size (no pixel read), so an "
        "image cut short after its header passes. --verify catches those, reading every image byte (slower).",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (where the forecast runs)")
    g.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: --workers processes on this machine (default); ray: a Ray Data map_batches over a Ray "
        "cluster (pip install 'vlm-pack[ray]'), the same lengths bit for bit",
    )
    g.add_argument(
        "--address",
        metavar="ADDR",
        help="--engine ray: the cluster to join (auto, ray://head:10001; default: the RAY_ADDRESS cluster, "
        "else a local one on this machine)",
    )
    g.add_argument(
        "--lengths",
        metavar="FILE",
        help="also write the lengths table as parquet (row, key, source, text_tokens, vision_tokens, length, "
        "image_tokens per image; vlm_pack.data.read_lengths reads it back, vlm_pack.data.plan_from_lengths plans "
        "from it)",
    )


def _add_pack_args(p: argparse.ArgumentParser, *, multi: bool) -> None:
    """The packing flags: ``PackingConfig``'s settings, named as there (``--max-samples-per-bin`` is
    ``max_samples_per_bin``), with its values and defaults; an analysis alone counts too-long samples by
    default (``--oversized skip``) instead of stopping at the first: measuring them is its job."""
    g = p.add_argument_group("packing")
    if multi:
        g.add_argument(
            "--capacity",
            type=_positive_int,
            nargs="+",
            default=[8192, 12288, 16384],
            help="tokens per pack; several values are compared (default 8192 12288 16384)",
        )
    else:
        g.add_argument("--capacity", type=_positive_int, required=True, help="tokens per pack")
    g.add_argument("--strategy", choices=("bfd", "ffd", "ff", "nf"), default="bfd", help="default bfd")
    oversized = "skip" if multi else _DEFAULTS.oversized
    g.add_argument(
        "--oversized",
        choices=OVERSIZED,
        default=oversized,
        help=f"a sample longer than the capacity: raise (stop, naming it), skip (leave it out) or truncate "
        f"(count it cut to the capacity); skipped and cut samples are reported (default {oversized})",
    )
    g.add_argument(
        "--max-samples-per-bin",
        type=_positive_int,
        metavar="N",
        help="at most N samples per pack (default: no cap); caps the attention blocks a pack holds",
    )
    g.add_argument(
        "--vision-capacity",
        type=_positive_int,
        metavar="N",
        help="at most N of --vision-cost per pack (default: no cap; bounds the ViT's activation memory); a "
        "sample over it on its own is handled as --oversized says (truncate: skipped, reported)",
    )
    g.add_argument(
        "--vision-cost",
        choices=VISION_COST,
        default=_DEFAULTS.vision_cost,
        help=f"what --vision-capacity counts: vision-encoder patches or images (default {_DEFAULTS.vision_cost})",
    )
    g.add_argument(
        "--pad-to-multiple-of",
        type=_positive_int,
        default=_DEFAULTS.pad_to_multiple_of,
        metavar="M",
        help="plan each sample on its length rounded up to M, the span a collator with pad_to_multiple_of=M "
        "gives it (context parallelism; default 1)",
    )


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost (what a pack costs the model to train, for ranks in step)")
    g.add_argument(
        "--model-config",
        metavar="PATH",
        help="the config.json saved beside your checkpoint (or its folder; read with transformers' AutoConfig): "
        "packs are costed with its widths and depths (vlm_pack.packing.PackCost.from_config) when balancing "
        "--world-size ranks. Default: PackCost() (Qwen2-VL-7B); a plan costed for another model is exact but "
        "its ranks wait longer",
    )


def _add_baseline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the padded run to compare with")
    g.add_argument(
        "--batch-size", type=_positive_int, default=4, help="samples per device per step (default 4)"
    )
    g.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel ranks (default 1)")
    g.add_argument(
        "--grad-accum", type=_positive_int, default=4, help="its gradient accumulation (default 4)"
    )
    g.add_argument(
        "--target-samples-per-update",
        type=_positive_int,
        help="samples per optimizer update to match (default batch-size x world-size x grad-accum)",
    )
    g.add_argument(
        "--packs-per-device", type=_positive_int, default=1, help="packs per device per step (default 1)"
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--out", metavar="DIR", default="vlm-pack-report", help="report folder (default ./vlm-pack-report)"
    )
    g.add_argument("--no-plots", action="store_true", help="write report.json / report.txt only")
    g.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")


def build_parser() -> argparse.ArgumentParser:
    """The ``vlm-pack`` argument parser (subcommands ``analyze``, ``pack``, ``plan``, ``demo``)."""
    from vlm_pack._version import __version__

    parser = argparse.ArgumentParser(
        prog="vlm-pack",
        description="Pack image-text samples for VLM training: measure the savings, write a pack plan.",
    )
    parser.add_argument("--version", action="version", version=f"vlm-pack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{analyze,pack,plan,demo}")

    _add_analyze(sub)
    _add_pack(sub)
    _add_plan(sub)
    _add_demo(sub)
    return parser


def _add_analyze(sub: Any) -> None:
    """``vlm-pack analyze``: the savings report."""
    a = sub.add_parser(
        "analyze",
        help="padding waste vs packing per capacity, samples per pack, grad-accum equivalent; report folder",
        description="Forecast lengths from text + image headers, pack at each capacity, compare with padded "
        "batches. With no SOURCES, analyzes the embedded demo dataset.",
    )
    a.add_argument(
        "sources", nargs="*", metavar="SOURCES", help=_SOURCES_HELP
    )
    _add_forecast_args(a)
    _add_engine_args(a)
    _add_pack_args(a, multi=True)
    _add_baseline_args(a)
    _add_cost_args(a)
    _add_output_args(a)


def _add_pack(sub: Any) -> None:
    """``vlm-pack pack``: a JSONL pack plan."""
    k = sub.add_parser(
        "pack",
        help="write a pack plan: which sample keys go together (JSONL, one pack per line)",
        description="Pack SOURCES at one capacity and write the plan for offline pre-packing.",
    )
    k.add_argument("sources", nargs="+", metavar="SOURCES", help=_SOURCES_HELP)
    _add_forecast_args(k)
    _add_engine_args(k)
    _add_pack_args(k, multi=False)
    k.add_argument("--out", metavar="FILE", required=True, help="the plan, e.g. plan.jsonl")
    k.add_argument(
        "--shuffle-seed",
        type=int,
        default=_DEFAULTS.shuffle_seed,
        metavar="N",
        help="shuffle the order of packs with seed N (default: creation order; decreasing strategies open "
        "the longest packs first, a length curriculum)",
    )


def _add_plan(sub: Any) -> None:
    """``vlm-pack plan``: a datasets folder's plan folder."""
    p = sub.add_parser(
        "plan",
        help="build a datasets folder's plan once (bins dealt to ranks) for PackedMapDataset(dataset, pre, plan=DIR)",
        description="Forecast a datasets save_to_disk folder (--engine local or ray), pack it, deal the packs to "
        "--world-size ranks, balanced by --model-config's cost, and save the plan folder every rank reads "
        "(PackedMapDataset(dataset, pre, plan=DIR, rank=r, balance=StepBalance(grad_accum=K, "
        "cost=PackCost.from_config(model.config)))) without forecasting again. Give the same checkpoint "
        "(--processor) the training job loads.",
    )
    p.add_argument("dataset", metavar="DATASET_DIR", help="a datasets save_to_disk folder")
    _add_forecast_args(p)
    _add_engine_args(p)
    _add_pack_args(p, multi=False)
    _add_cost_args(p)
    p.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument(
        "--grad-accum",
        type=_positive_int,
        default=1,
        help="packs per rank per optimizer step: each step's packs are balanced across ranks (default 1)",
    )
    p.add_argument(
        "--packs",
        choices=("auto", "balanced", "bfd"),
        default="auto",
        help="balanced: pack for the steps, each rank's share of a step about the same cost, where that deals "
        "better than the best-fit packs; bfd: the best-fit packs as they are; auto (default): balanced up to "
        "1 M samples (seconds), bfd above (where balanced packing takes minutes and gains ~1%%)",
    )
    p.add_argument("--out", metavar="PLAN_DIR", required=True, help="the plan folder, e.g. train.plan")


def _add_demo(sub: Any) -> None:
    """``vlm-pack demo``: the analysis on the embedded demo dataset."""
    m = sub.add_parser(
        "demo",
        help="analyze the embedded demo dataset (photos, documents, screenshots; realistic sizes)",
        description="Generate (once, cached) the demo shards and run `analyze` on them.",
    )
    m.add_argument("--num-samples", type=_positive_int, default=None, help="demo samples (default 320)")
    m.add_argument(
        "--data-dir", metavar="DIR", help="where to write the demo shards (default: a cache folder)"
    )
    _add_forecast_args(m)
    _add_pack_args(m, multi=True)
    _add_baseline_args(m)
    _add_cost_args(m)
    _add_output_args(m)

