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
    vlm-pack plan data/train/ --processor ./ckpt --model-config ./ckpt/config.json --capacity 16384 \
        --world-size 64 --grad-accum 4 --engine ray --address auto --out train.plan

``analyze`` reads WebDataset shards, parquet, JSON / JSONL (LLaVA-Instruct, ShareGPT, vlm-pack's manifest)
or a ``datasets`` ``save_to_disk`` folder in ``--workers N`` processes, forecasts every sample's expanded
length from the text and the image *headers* (no pixel decoded; ``--verify`` decodes every image too), packs at each
capacity, prints one column per capacity (padding waste of plain padded batches vs packed, samples per pack,
the grad-accumulation whose samples per optimizer update are closest to the padded run's) and writes ``report.json``, ``report.txt`` and PNG plots to
``--out`` (default ``./vlm-pack-report``). ``pack`` writes the bins as JSONL, one pack per line, for
offline pre-packing. ``plan`` builds a ``datasets`` folder's plan once (bins dealt to ``--world-size`` ranks, each
step balanced by ``--model-config``'s cost; forecast locally or with ``--engine ray``) and saves it as a plan folder every rank reads with ``PackedMapDataset(dataset, pre, plan=DIR, rank=r)``.
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

from vlm_pack.cli.model import cost_line, load_forecaster, model_cost
from vlm_pack.cli.parser import _family_name as _family_name  # the --family type, read here by old callers
from vlm_pack.cli.parser import build_parser
from vlm_pack.config import PackingConfig

__all__ = ["build_parser", "load_forecaster", "main"]



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
        max_bad_fraction=args.max_bad_fraction,
        max_image_pixels=args.max_image_pixels,
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
        max_bad_fraction=config.max_bad_fraction,
        max_image_pixels=config.max_image_pixels,
    )
    try:
        if engine == "ray":
            from vlm_pack.integrations.ray import forecast_ray

            table = forecast_ray(list(sources), num_proc=args.workers, address=args.address, **options)
        else:
            table = forecast_sources(list(sources), num_proc=args.workers or 1, **options)
    except SampleError as e:
        raise ValueError(
            f"{e}\n  Fix the sample, or pass --on-error skip to leave such samples out (they are listed in the "
            "report)."
        ) from None
    if len(table) == 0:
        names = ", ".join(str(s) for s in sources[:3]) + (
            f" (+{len(sources) - 3} more)" if len(sources) > 3 else ""
        )
        if all(reason == "empty_shard" for reason in table.invalid_reasons):  # none, or empty shards only
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
    cost, cost_source = model_cost(getattr(args, "model_config", None))  # before the forecast: fail fast
    _check_writable("--out", Path(args.out), folder=True)
    table, meta = _forecast(args, sources, config)
    packing = {k: v for k, v in config.to_dict().items() if k in ("max_samples_per_bin", "vision_capacity",
               "vision_cost", "oversized", "pad_to_multiple_of")}  # fmt: skip
    meta = {"source": label, "sources": [str(s) for s in sources], **meta, "packing_config": packing}
    meta["cost_model"] = {"source": cost_source, **(cost or _default_cost()).to_dict()}
    for capacity in args.capacity:
        _refuse_oversized(table, config.replace(capacity=capacity))
    report, results = analyze(
        table, args.capacity, baseline=baseline, strategy=args.strategy, meta=meta, config=config, cost=cost
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


def _default_cost() -> Any:
    from vlm_pack.packing.cost import PackCost

    return PackCost()


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
    from vlm_pack.data.plan import _check_replaceable, open_dataset, plan_from_lengths

    if args.verify:
        raise ValueError("--verify: a plan reads image headers only; run `vlm-pack analyze --verify` first.")
    if args.engine == "local" and args.address:
        raise ValueError("--address names a Ray cluster: pass --engine ray with it.")
    out = Path(args.out)
    _check_replaceable(out)
    _check_writable("--out", out.parent, folder=True)
    if args.lengths:
        _check_writable("--lengths", Path(args.lengths).parent, folder=True)
    cost, cost_source = model_cost(args.model_config)  # before the forecast: a bad config fails fast
    pre = _plan_preprocessor(args)
    config = _packing_config(args, args.capacity)
    ds, root = open_dataset(args.dataset, args.image_root, "vlm-pack plan")
    table = _plan_forecast(args, ds, root, pre, config)
    plan = plan_from_lengths(
        table, config, dataset=ds, preprocessor=pre, world_size=args.world_size, strategy=args.strategy,
        record_format=args.record_format, image_root=root, grad_accum=args.grad_accum, packs=args.packs, cost=cost,
    )  # fmt: skip
    plan.save(out)
    print(
        f"vlm-pack plan: {plan.num_samples:,} samples in {plan.num_bins:,} packs of {args.capacity:,} tokens, "
        f"{plan.steps:,} optimizer steps x {plan.world_size} rank(s) ({plan.micro_steps:,} micro-steps per rank, "
        f"grad-accum {plan.grad_accum}); {len(plan.skipped):,} left out"
    )
    print(f"  {cost_line(cost or _default_cost(), cost_source)}")
    for key, where, reason in plan.skipped[:5]:
        print(f"    {key} ({where}): {reason}")
    print(f"plan: {out} (digest {plan.digest})")
    return 0


def _plan_forecast(args: argparse.Namespace, ds: Any, root: Path | None, pre: Any, config: Any) -> Any:
    """The lengths table of the dataset ``ds``: ``--engine local`` (``--workers`` processes) or ``ray``
    (``vlm_pack.integrations.ray.forecast_ray``, as ``build_plan_ray`` forecasts); written to ``--lengths``."""
    options = dict(
        preprocessor=pre,
        record_format=args.record_format,
        image_root=root,
        exif_transpose=config.exif_transpose,
        on_error=config.on_error,
        progress=False if args.no_progress else None,
        max_consecutive_failures=config.max_consecutive_failures,
        max_bad_fraction=config.max_bad_fraction,
        max_image_pixels=config.max_image_pixels,
    )
    if args.engine == "ray":
        from vlm_pack.integrations.ray import forecast_ray

        table = forecast_ray(ds, num_proc=args.workers, address=args.address, **options)
    else:
        from vlm_pack.data.forecast import forecast_sources

        table = forecast_sources(ds, num_proc=args.workers or 1, **options)
    if args.lengths:
        from vlm_pack.data.lengths import write_lengths

        write_lengths(table, args.lengths)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vlm-pack``; returns the exit status (0 ok, 1 bad data or arguments, 2 usage).

    Systematically bad data (``FailureBudgetError``: a failure budget spent, ``--max-bad-fraction`` or
    ``--max-consecutive-failures``) exits 1 too, its most common reason and fix on the last line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"analyze": _cmd_analyze, "pack": _cmd_pack, "plan": _cmd_plan, "demo": _cmd_demo}[args.command]
    from vlm_pack.failures import FailureBudgetError

    try:
        return handler(args)
    except FailureBudgetError as e:
        if os.environ.get("VLM_PACK_DEBUG"):
            raise
        # the message ends with the most common reason and its fix: the line a user reads first
        print(f"vlm-pack {args.command}: error: {e}", file=sys.stderr)
        return 1
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
