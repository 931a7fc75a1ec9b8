"""The model the ``vlm-pack`` model flags name: the :class:`~vlm_pack.Preprocessor` of ``--family`` /
``--processor`` / ``--tokenizer`` (what a sample's length is) and the :class:`~vlm_pack.packing.PackCost` of
``--model-config`` (what a pack costs to train, for plans balanced across ranks).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from vlm_pack.families import DEFAULT_FAMILY, names

__all__ = ["cost_line", "load_forecaster", "model_cost"]


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


def model_cost(path: str | os.PathLike[str] | None) -> tuple[Any, str]:
    """``(PackCost, where it came from)`` of ``--model-config PATH``: a checkpoint's ``config.json`` (or its
    folder) read by transformers' ``AutoConfig.from_pretrained``, its widths and depths by
    ``PackCost.from_config``; no path: ``(None, ...)``, the default ``PackCost()`` (Qwen2-VL-7B's)."""
    if path is None:  # None, not PackCost(): the plan's key stays the one a consumer's StepBalance() gives
        return None, "PackCost() (Qwen2-VL-7B's widths; pass --model-config with your model's config.json)"
    from transformers import AutoConfig

    from vlm_pack.packing.cost import PackCost

    given = Path(path)
    if not given.exists():
        raise ValueError(
            f"--model-config {str(path)!r}: no such file or folder; give the config.json saved beside your "
            "checkpoint (or the checkpoint folder)."
        )
    try:
        config = AutoConfig.from_pretrained(given)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"--model-config {str(path)!r}: transformers cannot read it as a model config ({e}); give the "
            "config.json saved beside a checkpoint (it names its model_type)."
        ) from None
    text = getattr(config, "text_config", None) or config
    if not any(getattr(text, name, None) for name in ("hidden_size", "d_model", "n_embd")):
        raise ValueError(
            f"--model-config {str(path)!r}: its {type(config).__name__} names no hidden size (hidden_size, "
            "d_model or n_embd, at the top or in text_config): the plan cannot cost packs for it."
        )
    return PackCost.from_config(config), f"{config.model_type} config {given}"


def cost_line(cost: Any, source: str) -> str:
    """One line saying which cost model a plan or report is balanced by."""
    vision = f"; vision tower {cost.vision_layers} x {cost.vision_hidden_size}" if cost.vision_layers else ""
    return (
        f"costed by {source}: language model {cost.num_layers} layers x {cost.hidden_size} (MLP "
        f"{cost.intermediate_size}){vision}"
    )
