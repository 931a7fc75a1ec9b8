"""``vlm-pack``: how much packing saves on your data, and the pack plan to train with.

::

    vlm-pack demo                                  # the analysis on the embedded demo dataset
    vlm-pack analyze shards/{000..099}.tar --processor ./Qwen2-VL-7B-Instruct --capacity 8192 16384 \\
        --batch-size 2 --world-size 8 --grad-accum 8   # the padded run to compare with
    vlm-pack analyze data/manifest.jsonl --family llava_next
    vlm-pack analyze llava_v1_5_mix665k.json --image-root ./images --workers 8
    vlm-pack analyze train-*.parquet --processor ./ckpt          # HF hub parquet with Image columns
    vlm-pack pack shards/ --processor ./ckpt --capacity 16384 --out plan.jsonl
    vlm-pack plan data/train/ --processor ./ckpt --capacity 16384 --world-size 64 --out train.plan

``analyze`` reads WebDataset shards, parquet, JSON / JSONL (LLaVA-Instruct, ShareGPT, vlm-pack's manifest)
or a ``datasets`` ``save_to_disk`` folder in ``--workers N`` processes, forecasts every sample's expanded
length from the text and the image *headers* (no pixel decoded; ``--verify`` decodes every image too), packs at each
capacity, prints one column per capacity (padding waste of plain padded batches vs packed, samples per pack,
the grad-accumulation whose samples per optimizer update are closest to the padded run's) and writes ``report.json``, ``report.txt`` and PNG plots to
``--out`` (default ``./vlm-pack-report``). ``pack`` writes the bins as JSONL, one pack per line, for
offline pre-packing. ``plan`` builds a ``datasets`` folder's plan once (bins dealt to ``--world-size`` ranks)
and saves it as a plan folder every rank reads with ``PackedMapDataset(dataset, pre, plan=DIR, rank=r)``.
``python -m vlm_pack`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_pack.config import ON_ERROR, OVERSIZED, VISION_COST, PackingConfig
from vlm_pack.families import DEFAULT_FAMILY, canonical, names

__all__ = ["build_parser", "load_forecaster", "main"]

# The defaults of every setting a flag shares with PackingConfig: its own (capacity aside).
_DEFAULTS = PackingConfig(capacity=1)

_SOURCES_HELP = (
    "WebDataset .tar shards (globs, {000..009}), .parquet files (HF Image columns), .json (LLaVA-Instruct, "
    "ShareGPT, LLaMA-Factory) and .jsonl files, save_to_disk folders, or folders of these"
)


def _budget(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _positive_int(text)


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
        "than --max-consecutive-failures in a row stop the run), or raise: stop at the first",
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
        "image_tokens per image; vlm_pack.data.lengths.read_lengths reads it back)",
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
    _add_output_args(a)

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

    p = sub.add_parser(
        "plan",
        help="build a datasets folder's plan once (bins dealt to ranks) for PackedMapDataset(dataset, pre, plan=DIR)",
        description="Forecast a datasets save_to_disk folder, pack it, deal the packs to --world-size ranks "
        "and save the plan folder every rank reads (PackedMapDataset(dataset, pre, plan=DIR, rank=r)) without "
        "forecasting again. Give the same checkpoint (--processor) the training job loads.",
    )
    p.add_argument("dataset", metavar="DATASET_DIR", help="a datasets save_to_disk folder")
    _add_forecast_args(p)
    _add_pack_args(p, multi=False)
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
    _add_output_args(m)
    return parser


def load_forecaster(args: argparse.Namespace) -> tuple[Any, bool]:
    """The :class:`~vlm_pack.Preprocessor` ``--family/--processor/--tokenizer`` describe, and whether
    its tokenizer is the checkpoint's own (exact text counts) rather than the offline stand-in."""
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.vision import vision_spec

    overrides = dict(args.spec)
    if args.max_pixels is not None:
        overrides["max_pixels"] = args.max_pixels
    if args.min_pixels is not None:
        overrides["min_pixels"] = args.min_pixels
    for flag in ("processor", "tokenizer", "image_root"):
        value = getattr(args, flag, None)
        if value is not None and not Path(value).is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {value!r} is not a directory.")
    if args.processor is not None:
        return _checkpoint_preprocessor(args, overrides), True
    family = args.family or DEFAULT_FAMILY
    if family not in names("chat_format"):
        raise ValueError(
            f"--family {family!r}: vlm-pack renders conversations for {', '.join(names('chat_format'))}; for "
            "another model, pass its --processor folder (its chat template renders the conversations)."
        )
    _check_spec_keys(vision_spec(family), overrides)
    spec = vision_spec(family, **overrides)
    if args.tokenizer is not None:
        return Preprocessor(_load_tokenizer(args.tokenizer), family=family, spec=spec), True
    from vlm_pack.offline import build_tokenizer

    return Preprocessor(build_tokenizer(family), family=family, spec=spec), False


def _load_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer folder {folder!r}: no tokenizer could be loaded ({e}).") from None


def _checkpoint_preprocessor(args: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    """``--processor DIR``: the checkpoint's processor (or its tokenizer + image processor where the processor
    class cannot be built, e.g. a video processor without torchvision), its chat template and its vision spec."""
    from dataclasses import replace

    from transformers import AutoProcessor

    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.vision import vision_spec_from_processor

    folder = Path(args.processor)
    processor = None
    if args.tokenizer is None:
        try:
            processor = AutoProcessor.from_pretrained(folder)
        except Exception:  # any failure (a video processor without torchvision ...): the route below still works
            processor = None
        if not hasattr(processor, "image_processor"):  # a folder without a processor class gives a tokenizer
            processor = None
    if processor is not None:
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
    else:
        image_processor = _load_image_processor(folder, args.processor)
        tokenizer = _load_tokenizer(args.tokenizer or args.processor)
        saved = folder / "chat_template.jinja"  # a processor's template is saved beside it, not in the tokenizer
        if not getattr(tokenizer, "chat_template", None) and saved.is_file():
            tokenizer.chat_template = saved.read_text()
    spec = vision_spec_from_processor(processor if processor is not None else image_processor)
    if overrides:
        _check_spec_keys(spec, overrides)
        spec = replace(spec, **overrides)
    family = args.family
    if not getattr(processor if processor is not None else tokenizer, "chat_template", None):
        family = family or getattr(spec, "variant", None) or spec.family
        if family not in names("chat_format"):
            raise ValueError(
                f"--processor {args.processor!r} has no chat template (chat_template.jinja) and vlm-pack has no "
                f"chat format for {family!r}: add the checkpoint's chat_template.jinja to the folder, or pass "
                f"--family (one of {', '.join(names('chat_format'))}) with the same format."
            )
    return Preprocessor(tokenizer, image_processor, processor, family=family, spec=spec)


def _load_image_processor(folder: Path, given: str) -> Any:
    """The image processor saved in ``folder``; its PIL class where transformers' choice needs torchvision
    (transformers 5.6's ``AutoImageProcessor`` needs it for every class)."""
    from transformers import AutoImageProcessor

    from vlm_pack._compat import pil_image_processor_class

    try:
        return AutoImageProcessor.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"--processor {given!r}: no image processor could be loaded ({e}).") from None
    except ImportError:  # torchvision missing: the PIL class of the saved type loads without it
        config = _saved_image_processor_config(folder)
        if not config.get("image_processor_type"):
            raise
        return pil_image_processor_class(config["image_processor_type"]).from_dict(config)


def _saved_image_processor_config(folder: Path) -> dict[str, Any]:
    """The image processor's settings as saved in ``folder``: ``preprocessor_config.json``, else the
    ``image_processor`` entry of ``processor_config.json`` (where a processor saves them); {} if neither."""
    import json

    alone, nested = folder / "preprocessor_config.json", folder / "processor_config.json"
    if alone.is_file():
        return json.loads(alone.read_text())
    if nested.is_file():
        return json.loads(nested.read_text()).get("image_processor", {})
    return {}


def _check_spec_keys(spec: Any, overrides: dict[str, Any]) -> None:
    """Refuse ``--spec KEY=...`` for a KEY ``spec`` does not have, listing the ones it has."""
    import dataclasses

    valid = sorted(f.name for f in dataclasses.fields(spec) if f.init and f.name not in ("family", "variant"))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        flags = ", ".join(f"--spec {k}=..." for k in unknown)
        raise ValueError(
            f"{flags}: the {spec.family} vision spec has no such parameter; valid keys: {', '.join(valid)}."
        )


def _packing_config(args: argparse.Namespace, capacity: int) -> Any:
    """The one :class:`~vlm_pack.config.PackingConfig` the flags describe (at ``capacity``)."""
    return PackingConfig.resolve(
        f"vlm-pack {args.command}",
        capacity=capacity,
        max_samples_per_bin=args.max_samples_per_bin,
        vision_capacity=args.vision_capacity,
        vision_cost=args.vision_cost,
        oversized=args.oversized,
        pad_to_multiple_of=args.pad_to_multiple_of,
        on_error=args.on_error,
        exif_transpose=not args.no_exif_transpose,
        max_consecutive_failures=args.max_consecutive_failures,
        shuffle_seed=getattr(args, "shuffle_seed", None),
    )


def _check_writable(flag: str, path: Path, *, folder: bool) -> None:
    """Fail before the (long) forecast when ``path`` cannot be written, naming ``flag`` and the path."""
    target = path if folder else path.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".vlm-pack-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = "folder" if folder else "file"
        raise ValueError(
            f"{flag} {str(path)!r}: cannot write there ({e.strerror or e}); give {flag} a writable {what}."
        ) from None


def _stand_in_note(meta: dict[str, Any]) -> None:
    if meta["tokenizer"] != "exact":
        print(
            "vlm-pack: note: text tokens are counted with vlm-pack's offline stand-in tokenizer; pass "
            "--processor (or --tokenizer) with your checkpoint's folder for exact counts.",
            file=sys.stderr,
        )


def _baseline(args: argparse.Namespace) -> Any:
    from vlm_pack.report import Baseline

    return Baseline(
        batch_size=args.batch_size,
        world_size=args.world_size,
        grad_accum=args.grad_accum,
        packs_per_device=args.packs_per_device,
        target_samples_per_update=args.target_samples_per_update,
    )


def _forecast(
    args: argparse.Namespace, sources: Sequence[str | os.PathLike[str]], config: Any
) -> tuple[Any, dict[str, Any]]:
    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.data.shards import SampleError

    pre, exact = load_forecaster(args)
    engine = getattr(args, "engine", "local")  # `demo` has no engine flags
    if engine == "local" and getattr(args, "address", None):
        raise ValueError("--address names a Ray cluster: pass --engine ray with it.")
    if getattr(args, "lengths", None):
        _check_writable("--lengths", Path(args.lengths).parent, folder=True)
    options = dict(
        preprocessor=pre,
        record_format=args.record_format,
        image_root=args.image_root,
        exif_transpose=config.exif_transpose,
        verify=args.verify,
        on_error=config.on_error,
        progress=False if args.no_progress else None,
        max_consecutive_failures=config.max_consecutive_failures,
    )
    try:
        if engine == "ray":
            from vlm_pack.integrations.ray import forecast_ray

            table = forecast_ray(list(sources), num_proc=args.workers, address=args.address, **options)
        else:
            table = forecast_sources(list(sources), num_workers=args.workers or 1, **options)
    except SampleError as e:
        raise ValueError(
            f"{e}\n  Fix the sample, or pass --on-error skip to leave such samples out (they are listed in the "
            "report)."
        ) from None
    if len(table) == 0:
        names = ", ".join(str(s) for s in sources[:3]) + (
            f" (+{len(sources) - 3} more)" if len(sources) > 3 else ""
        )
        if not table.invalid:
            raise ValueError(f"no samples in {names}: they hold no records.")
        key, where, reason = table.invalid[0]
        raise ValueError(
            f"no valid samples in {names}: all {len(table.invalid):,} were skipped; the first, {key!r} "
            f"({where}): {reason}"
        )
    if getattr(args, "lengths", None):
        from vlm_pack.data.lengths import write_lengths

        write_lengths(table, args.lengths)
    if table.invalid:  # on_error="skip": left out, listed in the report, and said here
        key, where, reason = table.invalid[0]
        print(
            f"vlm-pack: warning: {len(table.invalid):,} sample(s) could not be read and are left out (listed "
            f"in the report); the first, {key!r} ({where}): {reason}. --on-error raise stops at the first.",
            file=sys.stderr,
        )
    meta = {
        "family": pre.family,
        "checkpoint_chat_template": bool(
            getattr(pre.processor if pre.processor is not None else pre.tokenizer, "chat_template", None)
        ),
        "vision_spec": pre.spec.to_dict(),
        "tokenizer": "exact" if exact else "vlm-pack offline stand-in",
        "exif_transpose": not args.no_exif_transpose,
        "images_checked": "decoded (--verify)" if args.verify else "header only",
    }
    return table, meta


def _too_small(table: Any, capacities: Sequence[int]) -> str:
    import numpy as np

    lengths = table.lengths
    caps = ", ".join(f"{c:,}" for c in capacities)
    return (
        f"capacity {caps} packs none of the {len(table):,} samples: the shortest sample is "
        f"{int(lengths.min()):,} tokens (median {int(np.median(lengths)):,}, longest {int(lengths.max()):,})"
    )


def _refuse_oversized(table: Any, config: Any) -> None:
    """Under ``--oversized raise``: stop at the first sample that fits no pack of ``config``, naming it (its
    key and where it lives) and the flags that go on."""
    import numpy as np

    from vlm_pack.packing import padded_lengths

    if config.oversized != "raise" or len(table) == 0:
        return
    over = padded_lengths(table.lengths, config.pad_to_multiple_of) > config.capacity
    if config.vision_capacity is not None:
        cost = table.num_images if config.vision_cost == "images" else table.num_patches
        over |= cost > config.vision_capacity
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"{table.sources[i]} (key {table.keys[i]!r}): {int(table.lengths[i]):,} tokens, "
            f"{int(table.num_images[i])} image(s) fit no pack of capacity {config.capacity:,}"
            + (f" and vision capacity {config.vision_capacity} {config.vision_cost}" if config.vision_capacity else "")
            + f" ({int(over.sum()):,} such samples). Raise --capacity, or pass --oversized skip (leave them "
            "out, listed) or --oversized truncate (cut them to the capacity)."
        )


def _run_analysis(
    args: argparse.Namespace, sources: Sequence[str | os.PathLike[str]], label: str, demo: bool
) -> int:
    from vlm_pack.report import analyze, format_report, write_report

    config = _packing_config(args, args.capacity[0])
    baseline = _baseline(args)
    _check_writable("--out", Path(args.out), folder=True)
    table, meta = _forecast(args, sources, config)
    packing = {k: v for k, v in config.to_dict().items() if k in ("max_samples_per_bin", "vision_capacity",
               "vision_cost", "oversized", "pad_to_multiple_of")}  # fmt: skip
    meta = {"source": label, "sources": [str(s) for s in sources], **meta, "packing_config": packing}
    for capacity in args.capacity:
        _refuse_oversized(table, config.replace(capacity=capacity))
    report, results = analyze(
        table, args.capacity, baseline=baseline, strategy=args.strategy, meta=meta, config=config
    )
    empty = [c["capacity"] for c in report["capacities"] if c["packed_samples"] == 0]
    if len(empty) == len(report["capacities"]):
        raise ValueError(
            _too_small(table, empty) + "; raise --capacity or pass --oversized truncate (count them cut)."
        )
    if empty:
        print(f"vlm-pack: warning: {_too_small(table, empty)}.", file=sys.stderr)
    if not demo:
        _stand_in_note(meta)
    if not args.no_plots and "MPLBACKEND" not in os.environ:
        try:
            import matplotlib

            matplotlib.use("Agg")  # files only: never a GUI window, and no display needed
        except ImportError:
            pass  # write_report notes that the plots were skipped
    paths = write_report(
        args.out,
        report,
        table,
        results,
        baseline=baseline,
        strategy=args.strategy,
        plots=not args.no_plots,
        config=config,
    )
    if args.json:
        print(Path(paths[0]).read_text(), end="")
    else:
        print(format_report(report))
        print(f"\nreport: {args.out}/ ({', '.join(p.name for p in paths)})")
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    if not args.sources:
        return _cmd_demo(args)
    label = (
        args.sources[0] if len(args.sources) == 1 else f"{args.sources[0]} (+{len(args.sources) - 1} more)"
    )
    return _run_analysis(args, args.sources, label, demo=False)


def _cmd_demo(args: argparse.Namespace) -> int:
    from vlm_pack.demo import DEMO_NUM_SAMPLES, demo_shards

    n = getattr(args, "num_samples", None) or DEMO_NUM_SAMPLES
    shards = demo_shards(
        getattr(args, "data_dir", None), num_samples=n, progress=False if args.no_progress else None
    )
    return _run_analysis(args, shards, f"vlm-pack demo ({n} samples)", demo=True)


def _write_plan(out: Path, table: Any, result: Any) -> None:
    """The plan as JSON lines, one pack a line: its tokens, and its samples' keys, lengths and sources."""
    # as lists once: every sample is written, and a Strings item is rebuilt from its block each time indexed
    keys, sources, vis = table.keys.tolist(), table.sources.tolist(), table.vision_tokens
    with open(out, "w") as f:
        for pack_index, members in enumerate(result.bins):
            line: dict[str, Any] = {
                "pack": pack_index,
                "tokens": int(result.bin_lengths[pack_index]),
                "vision_tokens": int(vis[members].sum()),
                "keys": [keys[i] for i in members],
                "lengths": [int(result.lengths[i]) for i in members],
                "sources": [sources[i] for i in members],
            }
            cut = {keys[i]: int(result.truncated[i]) for i in members if i in result.truncated}
            if cut:
                line["truncated_from"] = cut
            f.write(json.dumps(line) + "\n")


def _cmd_pack(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a directory; give the plan's file name, e.g. plan.jsonl.")
    config = _packing_config(args, args.capacity)
    _check_writable("--out", out, folder=False)
    table, meta = _forecast(args, args.sources, config)
    if len(table) == 0:
        raise ValueError("no samples to pack: the sources are empty (or every sample was invalid).")
    _stand_in_note(meta)
    _refuse_oversized(table, config)
    result = table.pack(config, args.strategy)
    if result.num_bins == 0:
        raise ValueError(
            _too_small(table, [args.capacity]) + "; raise --capacity or pass --oversized truncate. "
            "No plan written."
        )
    _write_plan(out, table, result)
    keys, sources = table.keys, table.sources
    skipped = [
        {"key": keys[u.index], "source": sources[u.index], "reason": u.reason} for u in result.unpacked
    ]
    skipped += [{"key": k, "source": s, "reason": r} for k, s, r in table.invalid]
    meta_path = out.with_name(out.stem + ".meta.json")
    summary = {
        **meta,
        "capacity": args.capacity,
        "strategy": args.strategy,
        "oversized": args.oversized,
        "packing_config": config.to_dict(),
        "shuffle_seed": config.shuffle_seed,
        "samples": len(table) + len(table.invalid),
        "packed_samples": int(result.order.size),
        "packs": result.num_bins,
        "lower_bound": result.lower_bound,
        "efficiency": result.efficiency,
        "truncated": len(result.truncated),
        "skipped": skipped,
    }
    meta_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"vlm-pack pack: {result.order.size:,} of {summary['samples']:,} samples in {result.num_bins:,} packs of "
        f"{args.capacity:,} tokens (lower bound {result.lower_bound:,}), efficiency {result.efficiency:.1%}, "
        f"{result.order.size / max(1, result.num_bins):.2f} samples/pack"
    )
    if result.truncated:
        print(
            f"  {len(result.truncated):,} samples longer than the capacity are marked truncated_from in the plan"
        )
    if skipped:
        print(f"  {len(skipped):,} samples skipped (oversized or invalid), listed in {meta_path}:")
        for s in skipped[:5]:
            print(f"    {s['key']} ({s['source']}): {s['reason']}")
        if len(skipped) > 5:
            print(f"    ... and {len(skipped) - 5} more")
    print(f"plan: {out}  summary: {meta_path}")
    return 0


def _plan_preprocessor(args: argparse.Namespace) -> Any:
    """``load_forecaster``'s parts, with an image processor: ``--family`` alone plans with vlm-pack's offline
    stand-ins (a training job must load the same ones, or its plan check names them as changed)."""
    from vlm_pack.preprocessor import Preprocessor

    pre, exact = load_forecaster(args)
    if pre.image_processor is None:
        from vlm_pack.offline import image_processor

        overridden = bool(args.spec) or args.max_pixels is not None or args.min_pixels is not None
        spec = pre.spec if overridden else None  # None: read from the image processor, as a consumer does
        pre = Preprocessor(pre.tokenizer, image_processor(pre.family), family=pre.family, spec=spec)
    if not exact or args.processor is None:
        print(
            "vlm-pack: note: planning with vlm-pack's offline stand-in parts; a training job checks the plan "
            "against its own processor: pass --processor with the checkpoint folder it loads.",
            file=sys.stderr,
        )
    return pre


def _cmd_plan(args: argparse.Namespace) -> int:
    from vlm_pack.data.plan import _check_replaceable, build_plan
    from vlm_pack.packing.steps import StepBalance

    if args.verify:
        raise ValueError("--verify: a plan reads image headers only; run `vlm-pack analyze --verify` first.")
    out = Path(args.out)
    _check_replaceable(out)
    _check_writable("--out", out.parent, folder=True)
    pre = _plan_preprocessor(args)
    plan = build_plan(
        args.dataset,
        pre,
        _packing_config(args, args.capacity),
        world_size=args.world_size,
        strategy=args.strategy,
        record_format=args.record_format,
        image_root=args.image_root,
        num_proc=args.workers or 1,
        progress=False if args.no_progress else None,
        balance=StepBalance(grad_accum=args.grad_accum, packs=args.packs),
    )
    plan.save(out)
    print(
        f"vlm-pack plan: {plan.num_samples:,} samples in {plan.num_bins:,} packs of {args.capacity:,} tokens, "
        f"{plan.steps:,} per rank x {plan.world_size} rank(s); {len(plan.skipped):,} left out"
    )
    for key, where, reason in plan.skipped[:5]:
        print(f"    {key} ({where}): {reason}")
    print(f"plan: {out} (digest {plan.digest})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vlm-pack``; returns the exit status (0 ok, 1 bad data or arguments, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"analyze": _cmd_analyze, "pack": _cmd_pack, "plan": _cmd_plan, "demo": _cmd_demo}[args.command]
    try:
        return handler(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if os.environ.get("VLM_PACK_DEBUG"):
            raise
        print(f"vlm-pack {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vlm-pack: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
