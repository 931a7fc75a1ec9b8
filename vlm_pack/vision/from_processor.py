"""Specs from live Hugging Face processors: :func:`vision_spec_from_processor`.

One reader per image-processor class (``_READERS``) turns the parameters the processor stores into the
family's spec, so the forecast matches the checkpoint the processor was loaded from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..families import names
from .anyres import LlavaNextSpec, LlavaOnevisionSpec, LlavaSpec
from .families import vision_spec
from .patch_budget import Gemma4Spec
from .pixtral import PixtralSpec
from .smart_resize import Glm4vSpec, Qwen2VLSpec, Qwen3VLSpec
from .spec import VisionSpec
from .tiles import Gemma3nSpec, Gemma3Spec, Idefics3Spec, InternVLSpec, Lfm2VlSpec


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


_SUPPORTED_PROCESSORS = (
    "Qwen2VLImageProcessor[Pil] (Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor)",
    "Glm4vImageProcessor[Pil] (Glm4vProcessor: GLM-4.1V, GLM-4.5V)",
    "Glm46VImageProcessor[Pil] (Glm46VProcessor)",
    "LlavaImageProcessor[Pil] / CLIPImageProcessor (LlavaProcessor)",
    "LlavaNextImageProcessor[Pil] (LlavaNextProcessor)",
    "LlavaOnevisionImageProcessor[Pil] (LlavaOnevisionProcessor)",
    "GotOcr2ImageProcessor[Pil] (InternVLProcessor)",
    "Idefics3ImageProcessor[Pil] (Idefics3Processor)",
    "SmolVLMImageProcessor[Pil] (SmolVLMProcessor)",
    "Gemma3ImageProcessor[Pil] (Gemma3Processor)",
    "Lfm2VlImageProcessor (Lfm2VlProcessor; torchvision)",
    "Gemma4ImageProcessor[Pil] (Gemma4Processor)",
    "SiglipImageProcessor[Pil] (Gemma3nProcessor only)",
    "PixtralImageProcessor[Pil] (PixtralProcessor)",
)


class _Source(NamedTuple):
    """What a reader sees: the image processor, the full processor (or None) and their class names."""

    ip: Any
    processor: Any
    ip_name: str  # image processor class, backend suffix (Pil / Fast) stripped
    proc_name: str  # processor class, "" for a bare image processor


def _read_qwen(src: _Source) -> VisionSpec:
    ip, size = src.ip, _get(src.ip, "size")
    kwargs: dict[str, Any] = dict(
        patch_size=int(_get(ip, "patch_size")),
        merge_size=int(_get(ip, "merge_size")),
        temporal_patch_size=int(_get(ip, "temporal_patch_size")),
        min_pixels=int(_get(size, "shortest_edge")),
        max_pixels=int(_get(size, "longest_edge")),
    )
    if src.ip_name == "Glm46VImageProcessor":
        return Glm4vSpec(**kwargs, variant="glm46v")
    if src.ip_name == "Glm4vImageProcessor":  # GLM-4.1V and GLM-4.5V share the processor classes
        return Glm4vSpec(**kwargs)
    kwargs.update(_qwen_video_kwargs(getattr(src.processor, "video_processor", None)))
    if src.proc_name.startswith("Qwen3VL") or (not src.proc_name and kwargs["patch_size"] == 16):
        return Qwen3VLSpec(**kwargs)
    if src.proc_name.startswith("Qwen2_5"):
        kwargs["variant"] = "qwen2_5_vl"
    return Qwen2VLSpec(
        **{k: v for k, v in kwargs.items() if k not in ("cap_pixels_per_frame", "max_video_tokens")}
    )


def _read_llava(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    crop = _get(ip, "crop_size") if _get(ip, "do_center_crop", False) else _get(ip, "size")
    if src.ip_name != "LlavaNextImageProcessor" and _get(crop, "height") is None:
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
    if src.ip_name == "LlavaNextImageProcessor":
        return LlavaNextSpec(image_grid_pinpoints=_get(ip, "image_grid_pinpoints"), **kwargs)
    return LlavaSpec(**kwargs)


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
    return LlavaOnevisionSpec(**kwargs)


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
    return InternVLSpec(**kwargs)


def _read_idefics3(src: _Source) -> VisionSpec:
    ip, processor = src.ip, src.processor
    smolvlm = src.ip_name.startswith("SmolVLM")
    kwargs: dict[str, Any] = dict(
        longest_edge=int(_get(_get(ip, "size"), "longest_edge")),
        max_image_size=int(_get(_get(ip, "max_image_size"), "longest_edge")),
        do_resize=bool(_get(ip, "do_resize", True)),
        do_image_splitting=bool(_get(ip, "do_image_splitting", True)),
        variant="smolvlm" if smolvlm else "idefics3",
    )
    if processor is not None:
        kwargs["image_seq_len"] = int(_get(processor, "image_seq_len"))
        tok = getattr(processor, "tokenizer", None)
        if tok is not None:
            kwargs["newline_pair_tokens"] = len(tok("\n\n", add_special_tokens=False)["input_ids"])
    elif smolvlm:  # the image processor does not store it: the released checkpoint's
        kwargs["image_seq_len"] = vision_spec("smolvlm").image_seq_len  # type: ignore[attr-defined]
    return Idefics3Spec(**kwargs)


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
    return Lfm2VlSpec(**kwargs)


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
    return Gemma3Spec(**kwargs)


def _read_gemma4(src: _Source) -> VisionSpec:
    ip = src.ip
    names = ("patch_size", "pooling_kernel_size", "max_soft_tokens")
    return Gemma4Spec(**{name: int(_get(ip, name)) for name in names})


def _read_gemma3n(src: _Source) -> VisionSpec:
    """Gemma 3n's ``SiglipImageProcessor`` is SigLIP's generic one: only the processor around it says the
    model, and so the 256 tokens per image."""
    if src.proc_name != "Gemma3nProcessor":
        raise ValueError(
            f"vision_spec_from_processor: a bare {type(src.ip).__name__} does not say which model's images it "
            "prepares (vlm-pack reads it for Gemma 3n only): pass the Gemma3nProcessor, or vision_spec('gemma3n')."
        )
    return Gemma3nSpec(
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
                f"{src.proc_name}: processor patch_size {processor.patch_size} differs from the image "
                f"processor's {patch_size}; vlm_pack supports Pixtral processors where they agree."
            )
        kwargs["spatial_merge_size"] = merge
    return PixtralSpec(**kwargs)


#: Image processor class (backend suffix stripped) -> the reader that builds its spec.
_READERS: dict[str, Callable[[_Source], VisionSpec]] = {
    "Qwen2VLImageProcessor": _read_qwen,
    "Glm4vImageProcessor": _read_qwen,
    "Glm46VImageProcessor": _read_qwen,
    "LlavaImageProcessor": _read_llava,
    "CLIPImageProcessor": _read_llava,
    "LlavaNextImageProcessor": _read_llava,
    "LlavaOnevisionImageProcessor": _read_onevision,
    "GotOcr2ImageProcessor": _read_internvl,
    "Idefics3ImageProcessor": _read_idefics3,
    "SmolVLMImageProcessor": _read_idefics3,
    "Gemma3ImageProcessor": _read_gemma3,
    "Gemma4ImageProcessor": _read_gemma4,
    "SiglipImageProcessor": _read_gemma3n,
    "PixtralImageProcessor": _read_pixtral,
    "Lfm2VlImageProcessor": _read_lfm2_vl,
}


def vision_spec_from_processor(obj: Any) -> VisionSpec:
    """Build the spec from a Hugging Face image processor or processor instance.

    Reads the parameters the object stores (``patch_size``, ``merge_size``, ``size``, pinpoints, tile limits,
    and, from a full processor, ``image_seq_length`` / ``num_image_tokens`` / ``patch_size`` /
    ``vision_feature_select_strategy`` and the video processor's settings), so a spec always matches the
    checkpoint the processor was loaded from. A bare ``Qwen2VLImageProcessor`` with 16 px patches is taken as
    Qwen3-VL (image rules are the same; pass the full processor for the right video rules).
    """
    image_proc = getattr(obj, "image_processor", None)
    processor = obj if image_proc is not None else None
    image_proc = image_proc if image_proc is not None else obj
    ip_name = _strip_backend(type(image_proc).__name__)
    reader = _READERS.get(ip_name)
    if reader is not None:
        proc_name = type(processor).__name__ if processor is not None else ""
        return reader(_Source(image_proc, processor, ip_name, proc_name))
    what = (
        f"processor {type(obj).__name__!r} (image processor {type(image_proc).__name__!r})"
        if processor is not None
        else f"{type(obj).__name__!r}, which is not a supported image processor or processor instance"
    )
    raise ValueError(
        f"vision_spec_from_processor: unsupported {what}. Supported: {'; '.join(_SUPPORTED_PROCESSORS)}. "
        f"For other models build a spec directly: vision_spec(family, ...) with family in {', '.join(names('vision'))}."
    )
