"""Where vlm-pack meets other libraries' versions and private names.

1. The transformers releases vlm-pack supports, checked at ``import vlm_pack`` without importing transformers.
2. Every private name of transformers, TRL, datasets and torch that vlm-pack reads or writes, one function
   each (the second half of this module), each checked by tests/test_private_apis.py.

``TRANSFORMERS_REQUIREMENT`` is pyproject.toml's requirement (a test keeps the two equal); below its lower
bound the suite fails in ways a user cannot fix from vlm-pack's side (measured per release in README.md,
"Supported versions"), so ``import vlm_pack`` stops with an error that names the range instead of a
``TypeError`` deep inside a model later. The version is read from the installed distribution's
``*.dist-info`` folder next to the package: ``importlib.metadata`` alone costs more than ``import vlm_pack``
(~50 ms against ~10 ms), and importing transformers costs seconds.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

TRANSFORMERS_REQUIREMENT = ">=5.6,<6"
TRANSFORMERS_MINIMUM = (5, 6)


def installed_transformers_version() -> str | None:
    """The version of the transformers that ``import transformers`` would load, from its dist-info folder;
    ``None`` when it is not installed or has no dist-info beside it (a source checkout on ``PYTHONPATH``)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    where = os.path.dirname(os.path.abspath(next(iter(spec.submodule_search_locations))))
    try:
        names = os.listdir(where)
    except OSError:
        return None
    prefix, suffix = "transformers-", ".dist-info"
    found = [n[len(prefix) : -len(suffix)] for n in names if n.startswith(prefix) and n.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def release(version: str) -> tuple[int, ...]:
    """``"5.6.2"`` -> ``(5, 6, 2)``; pre/dev/local suffixes dropped (``"5.25.0.dev0"`` -> ``(5, 25, 0)``)."""
    parts = []
    for part in version.split("."):  # no `re`: import vlm_pack loads as little as it can
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    if not parts:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(parts)


def check_transformers(version: str | None = None) -> None:
    """Raise ``ImportError`` naming the supported range when the installed transformers (or ``version``) is
    older than vlm-pack supports. Unknown versions pass: pip already enforced the requirement."""
    version = installed_transformers_version() if version is None else version
    if version is None or release(version)[:2] >= TRANSFORMERS_MINIMUM:
        return
    raise ImportError(
        f"vlm-pack needs transformers{TRANSFORMERS_REQUIREMENT}; transformers {version} is installed. "
        f"Upgrade it: pip install 'transformers{TRANSFORMERS_REQUIREMENT}' (README.md, 'Supported versions', "
        "says what each release was tested with)."
    )


def pil_image_processor_class(name: str) -> type:
    """The transformers PIL image processor class ``name`` (``"Idefics3ImageProcessorPil"``; a name without
    the ``Pil`` suffix, as ``preprocessor_config.json`` writes it, means its PIL class).

    transformers 5.6 lists some PIL processors (Idefics3's, SmolVLM's) at its top level as needing torchvision,
    which does not load beside a CPU torch, though their own modules import and run without it; there the
    class is read from its module.
    """
    import importlib
    import re

    import transformers

    name = name if name.endswith("Pil") else f"{name}Pil"
    cls = getattr(transformers, name, None)
    if cls is not None and type(cls).__name__ != "DummyObject":  # transformers' stand-in for a missing backend
        return cls
    stem = name.removesuffix("ImageProcessorPil")
    for module in dict.fromkeys([stem.lower(), re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower()]):
        try:
            found = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
        except ImportError:
            continue
        if hasattr(found, name):
            return getattr(found, name)
    raise ImportError(f"transformers {transformers.__version__} has no image processor {name}")


# --------------------------------------------------------------------------------------------------------
# Other libraries' private names, read here and nowhere else
# --------------------------------------------------------------------------------------------------------
# Each function below is the one place vlm-pack touches a private name of transformers, TRL, datasets or
# torch; tests/test_compat.py checks every one against the installed release, so an upstream rename fails
# that test by name instead of a forecast or a training step deep inside a run. Each says why no public name
# does the job (where one does, vlm-pack uses it and the private name is not here).


def compiled_chat_template(template: str) -> Any:
    """transformers' compiled, cached Jinja template for ``template``
    (``chat_template_utils._compile_jinja_template``). The public ``render_jinja_template`` deep-copies the
    messages on every call: a quarter of a forecast's rendering, for messages the sandbox cannot change."""
    from transformers.utils import chat_template_utils

    return chat_template_utils._compile_jinja_template(template)


def num_image_tokens(processor: Any, image_sizes: list[tuple[int, int]]) -> list[int]:
    """Image tokens per ``(height, width)`` as ``processor`` expands them
    (``ProcessorMixin._get_num_multimodal_tokens``, the count vLLM reads; no public method gives it without
    running the image processor on pixels)."""
    counts = processor._get_num_multimodal_tokens(image_sizes=image_sizes)["num_image_tokens"]
    return [int(n) for n in counts]


def image_step_missing(processor: Any) -> str | None:
    """Why :func:`process_images` cannot run ``processor`` (None where it can): transformers before 5.18 has
    no ``ProcessorMixin._process_images``, and a processor class that leaves ``replace_image_token`` to
    ``ProcessorMixin`` writes its image text in its own ``__call__``, which no other call reaches."""
    from transformers import ProcessorMixin

    if not hasattr(ProcessorMixin, "_process_images"):
        import transformers

        return f"transformers {transformers.__version__} has no ProcessorMixin._process_images (5.18 added it)"
    if getattr(type(processor), "replace_image_token", None) is ProcessorMixin.replace_image_token:
        return "its class does not implement replace_image_token (it writes its image text in its own __call__)"
    return None


def process_images(processor: Any, images: list[Any]) -> tuple[Any, list[str]]:
    """``processor``'s own image step of its ``__call__`` (``ProcessorMixin._process_images`` with the
    ``images_kwargs`` ``_merge_kwargs`` gives a call without arguments, transformers >= 5.18): the image
    processor's outputs for ``images`` and the text written in place of each image. The first argument of
    ``_merge_kwargs`` is positional on every release (5.18: required; 5.25: optional)."""
    merged = processor._merge_kwargs(
        processor.valid_processor_kwargs,
        tokenizer_init_kwargs=getattr(processor.tokenizer, "init_kwargs", {}),
        return_tensors="np",
    )
    step = processor._process_images
    kwargs = dict(merged["images_kwargs"])
    try:
        out, texts = step(images, **_step_arguments(step, merged, "images"), **kwargs)
    except KeyError as missing:  # a __call__ that moves a text setting to its image step first (5.18's LFM2-VL)
        name = missing.args[0] if missing.args else None
        if name not in merged.get("text_kwargs", {}) or name in kwargs:
            raise
        kwargs[name] = merged["text_kwargs"][name]
        out, texts = step(images, **_step_arguments(step, merged, "images"), **kwargs)
    return out, [str(text) for text in texts]


def _step_arguments(step: Any, merged: dict[str, Any], first: str) -> dict[str, Any]:
    """The named arguments a processor's own step takes besides ``first`` and its modality kwargs, as its
    ``__call__`` passes them from the merged kwargs (LFM2-VL's ``_process_images(images,
    use_image_special_tokens, **kwargs)``, models/lfm2_vl/processing_lfm2_vl.py); a TypeError naming one that
    the merged kwargs do not hold."""
    import inspect

    out = {}
    for name, param in inspect.signature(step).parameters.items():
        if name == first or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        for where in (merged, merged.get("text_kwargs", {}), merged.get(f"{first}_kwargs", {})):
            if name in where:
                out[name] = where[name]
                break
        else:
            if param.default is param.empty:
                raise TypeError(f"{type(step.__self__).__name__}'s own {first} step needs {name!r}, which only "
                                "its __call__ computes")  # fmt: skip
    return out


def video_step_missing(processor: Any) -> str | None:
    """Why :func:`process_videos` cannot run ``processor`` (None where it can): as
    :func:`image_step_missing`, for ``ProcessorMixin._process_videos`` and ``replace_video_token``."""
    from transformers import ProcessorMixin

    if not hasattr(ProcessorMixin, "_process_videos"):
        import transformers

        return f"transformers {transformers.__version__} has no ProcessorMixin._process_videos (5.18 added it)"
    if getattr(processor, "video_processor", None) is None or not isinstance(getattr(processor, "video_token", None), str):
        return "it has no video processor and video_token"
    if getattr(type(processor), "replace_video_token", None) is ProcessorMixin.replace_video_token:
        return "its class does not implement replace_video_token (it writes its video text in its own __call__)"
    return None


def process_videos(processor: Any, frames: Any, metadata: Any, **videos_kwargs: Any) -> tuple[Any, list[str]]:
    """``processor``'s own video step of its ``__call__`` (``ProcessorMixin._process_videos``) on ONE video's
    kept ``frames`` ``[T, H, W, 3]`` with its ``metadata`` (``frames_indices`` set) and sampling off, as
    ``process_sample`` hands decoded videos over: the video processor's outputs and the text written in place
    of the video. ``videos_kwargs``: call-time overrides, as given to the processor."""
    merged = processor._merge_kwargs(
        processor.valid_processor_kwargs,
        tokenizer_init_kwargs=getattr(processor.tokenizer, "init_kwargs", {}),
        return_tensors="pt",  # as process_sample calls it (Video-LLaMA 3's replace_video_token splits tensors)
        **videos_kwargs,
    )
    kwargs = {**merged["videos_kwargs"], "do_sample_frames": False, "video_metadata": [metadata]}
    step = processor._process_videos
    extra = {k: v for k, v in _step_arguments(step, merged, "videos").items() if k not in kwargs}
    out, texts = step([frames], **extra, **kwargs)
    return out, [str(text) for text in texts]


def set_named_special_tokens(tokenizer: Any, tokens: dict[str, str]) -> None:
    """Give ``tokenizer`` named model-specific special tokens (``tok.image_token`` / ``tok.image_token_id``,
    saved to tokenizer_config.json) after its vocabulary is built
    (``PreTrainedTokenizerBase._set_model_specific_special_tokens``). The public route,
    ``extra_special_tokens=`` at construction, names them before the tokens exist, which changes their ids."""
    tokenizer._set_model_specific_special_tokens(special_tokens=tokens)


def swap_attn_implementation(config: Any, name: str) -> str:
    """Set ``config``'s attention implementation to ``name``; returns the one it had (``config.
    _attn_implementation``, a property whose setter recurses into sub-configs). ``model.
    set_attn_implementation`` is the public setter but validates and re-dispatches the whole model; a
    reference forward switches one text config for one call and back."""
    before = config._attn_implementation
    config._attn_implementation = name
    return before


def model_from_config(model_cls: Any, config: Any, **kwargs: Any) -> Any:
    """A randomly initialised ``model_cls`` of ``config`` with ``attn_implementation=`` / ``dtype=``
    (``PreTrainedModel._from_config``: the class-level ``from_config`` exists only on the Auto classes, which
    pick their own class from the config)."""
    return model_cls._from_config(config, **kwargs)


def fast_encode_plus(cls: type) -> Any:
    """``cls._encode_plus`` (transformers' fast tokenizers' per-call encoder) or None: a tokenizer class that
    overrides it (or ``__call__``) does its own encoding, so its Rust tokenizer alone does not give its ids."""
    return getattr(cls, "_encode_plus", None)


def dataset_fingerprint(dataset: Any) -> str | None:
    """``datasets.Dataset``'s own content fingerprint (``Dataset._fingerprint``, updated by every transform
    and stable across processes); None for other objects. ``datasets`` has no public accessor: hashing the
    data again (``fingerprint.generate_fingerprint``) reads every table."""
    return getattr(dataset, "_fingerprint", None)


def sft_train_tokens(trainer: Any) -> int:
    """TRL ``SFTTrainer``'s running count of trained tokens (``_total_train_tokens``)."""
    return trainer._total_train_tokens


def set_sft_train_tokens(trainer: Any, tokens: int) -> None:
    """Set TRL ``SFTTrainer``'s trained-token count to ``tokens`` (``_total_train_tokens``, the logged
    ``num_tokens`` metric ``_metrics["train"]["num_tokens"]``), counting a packed row's real tokens, not its
    padding. TRL offers no hook for what a batch counts; the tensor-parallel size to divide a gathered count
    by is public (``Trainer.get_tp_size()``)."""
    trainer._total_train_tokens = tokens
    trainer._metrics["train"]["num_tokens"] = [tokens]


def shared_empty(like: Any, shape: tuple[int, ...]) -> Any:
    """An uninitialised CPU tensor of ``shape`` and ``like``'s dtype in shared memory, as ``default_collate``
    makes one in a DataLoader worker (``_typed_storage()._new_shared``): the batch crosses to the main process
    without a copy. ``share_memory_()``, the public route, allocates and then copies into shared memory."""
    import math

    storage = like._typed_storage()._new_shared(math.prod(shape), device=like.device)
    return like.new(storage).resize_(*shape)


def tensor_version(tensor: Any) -> int:
    """``tensor``'s in-place version counter (``Tensor._version``): a per-forward cache keyed by a tensor's
    identity sees an in-place edit by it. torch has no public accessor."""
    return tensor._version


#: The first transformers release whose processors report where they expanded each video
#: (``return_text_replacement_offsets``), which processing a video sample needs (``processing/placement.py``).
VIDEOS_SINCE = (5, 7)


def videos_supported(version: str | None = None) -> bool:
    """Whether the installed transformers (or ``version``) processes video samples: :data:`VIDEOS_SINCE` on."""
    version = installed_transformers_version() if version is None else version
    return version is not None and release(version)[:2] >= VIDEOS_SINCE


def mixers_refuse_packed_rows(version: str | None = None) -> bool:
    """Whether transformers' own token mixers (their PyTorch fallbacks: ``causal_conv1d_fn``,
    ``chunk_gated_delta_rule``) refuse the boundaries of a packed row (``seq_idx`` / ``cu_seq_lens``) on the
    installed release (or ``version``): 5.24 on ("can't keep packed sequences apart"); before, they ignore them
    and mix across samples (``forward.packed_calls.guard_packed_calls`` isolates a model at its first packed call on
    every release). It also marks the release line whose layer code ``forward.mixer_kernels``' recipes follow."""
    version = installed_transformers_version() if version is None else version
    return version is not None and release(version)[:2] >= (5, 24)


def timm_tower_without_sdpa(version: str | None = None) -> str | None:
    """Why a model whose vision tower is timm's (Gemma 3n's ``TimmWrapperModel``) cannot be built with sdpa
    attention on the installed transformers (or ``version``), or None: before 5.18 (measured on 5.6.0) it raises
    "TimmWrapperModel does not support an attention implementation through ...scaled_dot_product_attention";
    5.18 on builds it."""
    version = installed_transformers_version() if version is None else version
    if version is not None and release(version)[:2] < (5, 18):
        return f"transformers {version} builds a timm vision tower (TimmWrapperModel) with eager attention only"
    return None


def images_past_window(until: tuple[int, int] | None, version: str | None = None) -> bool:
    """Whether the installed transformers (or ``version``) is older than ``until`` (a family's
    ``images_past_window_until``): its sliding layers then let an image's tokens see their whole image past
    the window, and vlm-pack's packed masks do the same, so each sample gets the mask it gets alone.

    Gemma 4 before 5.13 (5.6.x ``modeling_gemma4.create_causal_mask_mapping``: ``create_sliding_window_causal_mask``
    with the image blocks as ``or_mask_function``): (causal AND window) OR same image; 5.13 on (transformers
    PR 46850, ``create_masks_for_vision_model``): (causal OR same image) AND window.
    """
    if until is None:
        return False
    version = installed_transformers_version() if version is None else version
    return version is not None and release(version)[:2] < tuple(until)


def processor_needs_torchvision(family: str) -> str | None:
    """Why ``family``'s processor does not load on the installed transformers without torchvision, or None.

    transformers 5.18 and 5.19's ``processing_gemma4.py`` imports its torchvision image processor module
    (``image_processing_gemma4``) at the top, although the processor uses only a helper from it (5.6's
    imports the PIL one, 5.24's neither): Gemma 4's processor needs torchvision there.
    """
    import importlib

    try:
        importlib.import_module(f"transformers.models.{family}.processing_{family}")
    except ModuleNotFoundError as err:
        if err.name != "torchvision":
            raise
        import transformers

        return (
            f"transformers {transformers.__version__}'s processing_{family}.py imports torchvision "
            "(its torchvision image processor module); not installed here"
        )
    return None


#: The first release whose Qwen3.5-MoE takes a per-layer-type attention-mask mapping (``modeling_qwen3_5_moe.py``:
#: ``if not isinstance(attention_mask, dict)``): 5.6's takes a 2-D mask only.
EXPERTS_MASK_MAPPING = (5, 18)


def check_experts_mask_mapping(family: str, version: str | None = None) -> None:
    """Raise naming the release when the installed transformers cannot take the mask mapping that keeps
    ``family``'s padding out of its router's aux loss (an ``AttributeError`` deep in the model otherwise)."""
    version = installed_transformers_version() if version is None else version
    if version is not None and release(version)[:2] < EXPERTS_MASK_MAPPING:
        need = ".".join(map(str, EXPERTS_MASK_MAPPING))
        raise ValueError(
            f"packed rows of {family} need transformers >= {need}: transformers {version}'s model takes a 2-D "
            "attention_mask only, so the mask that keeps padding out of the router's aux loss cannot reach it. "
            f"Upgrade transformers (pip install 'transformers>={need}')."
        )
