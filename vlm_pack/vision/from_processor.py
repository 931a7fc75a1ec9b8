"""Specs from live Hugging Face processors: :func:`vision_spec_from_processor`.

Which rule a processor gets is its class's, never a resemblance's::

    processor of a class a record names (Family.processors)      the record's fast rule, its settings read by
      or a subclass of one that rewrites none of its methods      the reader of that rule (_READERS)
    any other processor (a new model type; a subclass that       the exact route: the processor's own image
      rewrites how its parent writes text)                        step on blank canvases (oracle.py)
    bare image processor of a class one record names              that record's rule (it writes no text)
      (Family.image_processors)
    anything else                                                 refused by name, with the fix

One reader per vision rule (``_READERS``, keyed by the rule's ``"module.Class"``) turns the parameters the
processor stores into the record's spec, so the forecast matches the checkpoint the processor was loaded from.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

from ..families import FAMILIES, Family, owner
from .oracle import drives, exact_spec
from .spec import VisionSpec


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict, a transformers ``SizeDict`` or an attribute holder."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        value = obj.get(key, default)
    else:
        value = getattr(obj, key, default)
    return default if value is None else value


def _hw(size: Any, what: str) -> tuple[int, int]:
    """``(height, width)`` from a size dict with height/width or shortest_edge."""
    h, w = _get(size, "height"), _get(size, "width")
    if h is not None and w is not None:
        return int(h), int(w)
    se = _get(size, "shortest_edge")
    if se is not None:
        return int(se), int(se)
    raise ValueError(f"cannot read {what} from {size!r}: expected height/width or shortest_edge.")


def _strip_backend(name: str) -> str:
    for suffix in ("Pil", "Fast"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _qwen_video_kwargs(video: Any) -> dict[str, Any]:
    if video is None:
        return {}
    size = _get(video, "size")
    out: dict[str, Any] = {}
    if _get(size, "shortest_edge") is not None:
        out["video_min_pixels"] = int(_get(size, "shortest_edge"))
    if _get(size, "longest_edge") is not None:
        out["video_max_pixels"] = int(_get(size, "longest_edge"))
    for name in (
        "fps",
        "min_frames",
        "max_frames",
        "do_sample_frames",
        "cap_pixels_per_frame",
        "max_video_tokens",
    ):
        value = _get(video, name)
        if value is not None:
            out[name] = value
    return out


class _Source(NamedTuple):
    """What a reader sees: the image processor, the full processor (or None) and the record whose rule it
    builds (``record.vision``, with the released checkpoint's defaults under what the instance stores)."""

    ip: Any
    processor: Any
    record: Family

    def build(self, **kwargs: Any) -> VisionSpec:
        assert self.record.vision is not None  # only records with a rule name processor classes
        return self.record.vision(**kwargs)

    def rule_fields(self) -> set[str]:
        """The parameters the record's spec class takes."""
        assert self.record.vision is not None
        module, _, name = self.record.vision.path.rpartition(".")
        cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return {f.name for f in fields(cls)}


def _read_qwen(src: _Source) -> VisionSpec:
    ip, size = src.ip, _get(src.ip, "size")
    kwargs: dict[str, Any] = dict(
        patch_size=int(_get(ip, "patch_size")),
        merge_size=int(_get(ip, "merge_size")),
        temporal_patch_size=int(_get(ip, "temporal_patch_size")),
        min_pixels=int(_get(size, "shortest_edge")),
        max_pixels=int(_get(size, "longest_edge")),
    )
    kwargs.update(_qwen_video_kwargs(getattr(src.processor, "video_processor", None)))
    takes = src.rule_fields()  # Qwen2-VL's rule has no per-frame cap; GLM's reads no video settings here
    return src.build(**{k: v for k, v in kwargs.items() if k in takes})


def _read_llava(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    crop = _get(ip, "crop_size") if _get(ip, "do_center_crop", False) else _get(ip, "size")
    anyres = "image_grid_pinpoints" in src.rule_fields()
    if not anyres and _get(crop, "height") is None:
        # Without the center crop, a shortest_edge resize keeps the aspect ratio: a per-image count
        # the released LLaVA processors never produce.
        raise ValueError(
            f"{type(ip).__name__} with do_center_crop=False and size={crop!r}: the LLaVA token count then "
            "depends on the aspect ratio, which vlm_pack does not model; enable do_center_crop."
        )
    crop_h, crop_w = _hw(crop, "the crop size")
    kwargs: dict[str, Any] = dict(crop_height=crop_h, crop_width=crop_w)
    if processor is not None:
        kwargs.update(
            patch_size=int(_get(processor, "patch_size", 14)),
            num_additional_image_tokens=int(_get(processor, "num_additional_image_tokens", 0)),
            vision_feature_select_strategy=_get(processor, "vision_feature_select_strategy") or "full",
        )
    if anyres:
        return src.build(image_grid_pinpoints=_get(ip, "image_grid_pinpoints"), **kwargs)
    return src.build(**kwargs)


def _read_onevision(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    kwargs: dict[str, Any] = dict(
        image_grid_pinpoints=_get(ip, "image_grid_pinpoints"), size=_hw(_get(ip, "size"), "size")[0]
    )
    if processor is not None:
        kwargs.update(
            num_image_tokens=int(_get(processor, "num_image_tokens", 729)),
            vision_aspect_ratio=_get(processor, "vision_aspect_ratio", "anyres_max_9"),
            vision_feature_select_strategy=_get(processor, "vision_feature_select_strategy") or "full",
        )
    return src.build(**kwargs)


def _read_internvl(src: _Source) -> VisionSpec:
    ip = src.ip
    kwargs: dict[str, Any] = dict(
        tile_size=_hw(_get(ip, "size"), "size")[0],
        min_tiles=int(_get(ip, "min_patches", 1)),
        max_tiles=int(_get(ip, "max_patches", 12)),
        crop_to_patches=bool(_get(ip, "crop_to_patches", False)),
    )
    if src.processor is not None:
        kwargs["image_seq_length"] = int(_get(src.processor, "image_seq_length", 256))
    return src.build(**kwargs)


def _read_idefics3(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    kwargs: dict[str, Any] = dict(
        longest_edge=int(_get(_get(ip, "size"), "longest_edge")),
        max_image_size=int(_get(_get(ip, "max_image_size"), "longest_edge")),
        do_resize=bool(_get(ip, "do_resize", True)),
        do_image_splitting=bool(_get(ip, "do_image_splitting", True)),
    )
    if processor is not None:
        kwargs["image_seq_len"] = int(_get(processor, "image_seq_len"))
        tok = getattr(processor, "tokenizer", None)
        if tok is not None:
            kwargs["newline_pair_tokens"] = len(tok("\n\n", add_special_tokens=False)["input_ids"])
    # a bare image processor does not store image_seq_len: the record's released checkpoint's
    return src.build(**kwargs)


_LFM2_VL_FIELDS = (
    "encoder_patch_size",
    "downsample_factor",
    "min_image_tokens",
    "max_image_tokens",
    "do_image_splitting",
    "min_tiles",
    "max_tiles",
    "tile_size",
    "use_thumbnail",
    "max_pixels_tolerance",
)


def _read_lfm2_vl(src: _Source) -> VisionSpec:
    kwargs: dict[str, Any] = {name: _get(src.ip, name) for name in _LFM2_VL_FIELDS}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if src.processor is not None:
        kwargs["use_image_special_tokens"] = bool(_get(src.processor, "use_image_special_tokens", True))
    return src.build(**kwargs)


_PAN_AND_SCAN = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


def _read_gemma3(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    # preprocessor_config.json leaves pan-and-scan null; Gemma3Processor's images_kwargs fill them in.
    defaults = dict(getattr(processor, "images_kwargs", None) or {}) if processor is not None else {}
    kwargs: dict[str, Any] = dict(image_size=_hw(_get(ip, "size"), "size")[0])
    for name in _PAN_AND_SCAN:
        value = _get(ip, name, defaults.get(name))
        if value is not None:
            kwargs[name] = value
    if processor is not None:
        kwargs["image_seq_length"] = int(_get(processor, "image_seq_length", 256))
    return src.build(**kwargs)


def _read_gemma4(src: _Source) -> VisionSpec:
    ip = src.ip
    names = ("patch_size", "pooling_kernel_size", "max_soft_tokens")
    return src.build(**{name: int(_get(ip, name)) for name in names})


def _read_gemma3n(src: _Source) -> VisionSpec:
    """Gemma 3n's ``SiglipImageProcessor`` is SigLIP's generic one (no record names it for a bare instance):
    only the processor around it says the model, and so the 256 tokens per image."""
    return src.build(
        image_size=_hw(_get(src.ip, "size"), "size")[0],
        image_seq_length=int(_get(src.processor, "image_seq_length", 256)),
    )


def _read_pixtral(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    patch = _get(ip, "patch_size")
    patch_size = int(_get(patch, "height")) if not isinstance(patch, int) else patch
    kwargs: dict[str, Any] = dict(
        patch_size=patch_size, longest_edge=int(_get(_get(ip, "size"), "longest_edge"))
    )
    if processor is not None:
        merge = int(_get(processor, "spatial_merge_size", 1))
        if int(_get(processor, "patch_size", patch_size)) != patch_size:
            raise ValueError(
                f"{type(processor).__name__}: processor patch_size {processor.patch_size} differs from the image "
                f"processor's {patch_size}; vlm_pack supports Pixtral processors where they agree."
            )
        kwargs["spatial_merge_size"] = merge
    return src.build(**kwargs)


#: The vision rule (a record's ``vision.path``) -> the reader that builds it from a live processor.
_READERS: dict[str, Callable[[_Source], VisionSpec]] = {
    "smart_resize.Qwen2VLSpec": _read_qwen,
    "smart_resize.Qwen3VLSpec": _read_qwen,
    "smart_resize.Glm4vSpec": _read_qwen,
    "anyres.LlavaSpec": _read_llava,
    "anyres.LlavaNextSpec": _read_llava,
    "anyres.LlavaOnevisionSpec": _read_onevision,
    "tiles.InternVLSpec": _read_internvl,
    "tiles.Idefics3Spec": _read_idefics3,
    "tiles.Gemma3Spec": _read_gemma3,
    "tiles.Gemma3nSpec": _read_gemma3n,
    "tiles.Lfm2VlSpec": _read_lfm2_vl,
    "patch_budget.Gemma4Spec": _read_gemma4,
    "pixtral.PixtralSpec": _read_pixtral,
}

#: Methods a subclass may define and still be its parent's processor: the constructor's check of the parts it
#: is given and saving write no text (``vlm_pack.offline`` lets a processor be built, and saved, without a
#: video processor so).
_WRITES_NO_TEXT = frozenset({"check_argument_for_proper_class", "save_pretrained"})


def _rewritten(derived: tuple[type, ...]) -> list[str]:
    """What (``"Class.name"``) the classes ``derived`` (a processor class and its bases below the record's
    class) define themselves: methods and class attributes alike (a ``valid_processor_kwargs`` or a
    ``return_mm_token_type_ids`` changes what the parent writes too), except those that write no text and
    the metadata every class has (``__module__``, ``__doc__``, ...)."""
    out = []
    for cls in derived:
        for name in vars(cls):
            dunder = name.startswith("__") and name.endswith("__") and name not in ("__init__", "__call__")
            if not dunder and name not in _WRITES_NO_TEXT:
                out.append(f"{cls.__name__}.{name}")
    return out


def _processor_record(processor: Any) -> tuple[Family | None, list[str]]:
    """The record naming the class of ``processor`` (or its nearest transformers base class), and the methods
    the classes above that one rewrite (none: the record's rule applies)."""
    mro = type(processor).__mro__
    for depth, cls in enumerate(mro):
        record = owner("processors", cls.__name__)
        if record is not None and cls.__module__.startswith("transformers."):
            return record, _rewritten(mro[:depth])
    return None, []


def takes_exact_route(processor: Any) -> bool:
    """Whether a full ``processor`` is forecast by running it (images and videos alike): no record names its
    class, or it rewrites what its record's class writes (:func:`vision_spec_from_processor`)."""
    record, rewritten = _processor_record(processor)
    return record is None or bool(rewritten)


def _image_processor_record(image_processor: Any) -> Family | None:
    """The record naming the class of a bare ``image_processor`` (its ``Pil`` / ``Fast`` suffix dropped) or of
    its nearest transformers base class, or None. A bare subclass reads as its parent: it writes no text, and
    where it counts otherwise than its parent the processed sample's count differs from its forecast, which
    processing reports per sample (``forecast_mismatch``), unlike a processor's text, which nothing would."""
    for cls in type(image_processor).__mro__:
        if cls.__module__.startswith("transformers."):
            return owner("image_processors", _strip_backend(cls.__name__))
    return None


def _supported() -> str:
    """The processor and image processor classes with a fast rule, from the records."""
    rows = [
        f"{', '.join(r.processors)} / bare {', '.join(r.image_processors) or '-'} ({r.name})"
        for r in FAMILIES.values()
        if r.processors
    ]
    return "; ".join(rows)


def _read(record: Family, image_processor: Any, processor: Any) -> VisionSpec:
    assert record.vision is not None
    return _READERS[record.vision.path](_Source(image_processor, processor, record))


def vision_spec_from_processor(obj: Any) -> VisionSpec:
    """Build the spec from a Hugging Face processor or image processor instance.

    A processor whose class a family record names (``Family.processors``; a subclass that rewrites none of
    its methods counts as its parent) gets the record's fast rule, read from the parameters the instance
    stores (``patch_size``, ``merge_size``, ``size``, pinpoints, tile limits, ``image_seq_length`` /
    ``num_image_tokens`` / ``vision_feature_select_strategy``, the video processor's settings), so the spec
    matches the checkpoint the processor was loaded from. Any other processor, a new model type or a subclass
    that writes other text around the same images, gets the exact route
    (:class:`~vlm_pack.vision.oracle.ProcessorSpec`: its own image step on blank canvases), or, where that
    cannot run it, a ValueError naming it and the fix: no record's rule is applied by resemblance.

    A bare image processor is read with the rule of the one record naming its class
    (``Family.image_processors``); it writes no text around an image, so its counts are its own whatever
    model it came with (a bare ``Qwen2VLImageProcessor`` reads as Qwen2-VL's, 16 px patches too: pass the
    full processor for a model's video rules). Other image processors are refused: pass the full processor.
    """
    image_proc = getattr(obj, "image_processor", None)
    if image_proc is not None:  # a processor
        record, rewritten = _processor_record(obj)
        if record is not None and not rewritten:
            return _read(record, image_proc, obj)
        why = drives(obj)
        if why is None:
            return exact_spec(obj)
        name = type(obj).__name__
        reason = (
            f"{name} rewrites {', '.join(rewritten)} of the {record.name} record's processor, so that "
            "record's rule does not apply, and the exact route cannot run it: " + why
            if record is not None
            else f"no family record names processor {name!r} (image processor "
            f"{type(image_proc).__name__!r}), and the exact route cannot run it: {why}"
        )
        raise ValueError(
            f"vision_spec_from_processor: {reason}. Fast rules: {_supported()}. Upgrade transformers (>= 5.18 "
            "runs any processor that implements replace_image_token), or give spec=vision_spec(family, ...)."
        )
    record = _image_processor_record(obj)
    if record is not None:
        return _read(record, obj, None)
    if type(obj).__module__.startswith("transformers.") and hasattr(obj, "preprocess"):
        raise ValueError(
            f"vision_spec_from_processor: a bare {type(obj).__name__} does not say which model's images it "
            "prepares, nor what text goes around them: pass its full processor (AutoProcessor.from_pretrained), "
            f"or spec=vision_spec(family, ...). Bare image processors read: {_supported()}."
        )
    raise ValueError(
        f"vision_spec_from_processor: {type(obj).__name__!r} is not a supported image processor or processor "
        f"instance. Fast rules: {_supported()}; any other transformers processor takes the exact route."
    )
