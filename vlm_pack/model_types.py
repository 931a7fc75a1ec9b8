"""A route for model types vlm-pack has no record for: the model's own rules, applied per sample.

A model type without a :class:`~vlm_pack.families.Family` record (``lookup(model_type) is None``) is packed
from what transformers itself carries, never from a record it resembles:

- **processing**: the model's own processor (its output keys travel with the sample; per-token ones such as
  ``mm_token_type_ids`` are packed like ``input_ids``, the others joined in packed order);
- **positions**: restarting at 0 in every sample (1-D), or, where the model computes multimodal RoPE, the
  model's own rope-index function (``model.model.get_rope_index``) called on each sample alone, under a text
  row of per-sample aranges (transformers finds the sample boundaries from that row)::

      row 0           0 1 2 3 4 5 6 | 0 1 2 3          per-sample arange (packed detection)
      rows 1..k       get_rope_index(sample 0) | get_rope_index(sample 1)       each sample alone

- **masks**: transformers' own packed handling (no ``attention_mask``, ``use_cache=False``, positions that
  restart: ``masking_utils.find_packed_sequence_indices``), which is exact where the model's attention is
  causal text attention (REFERENCE section 2 / 7);
- **token mixers** (layers that are not attention: ``vlm_pack.forward.mixers.find_token_mixers``): known kinds
  isolated at the model's first packed call (``forward/packed_calls.py``), unknown ones refused.

A type where that is measured not to be exact (two-way image attention, cross-attention, an unknown mixer) is
refused by name (:data:`REFUSED`: always, or before the transformers release it packs exactly from) when a
collator is built for it. ``docs/families.md`` lists
every image-text-to-text model type of the installed transformers with its route and measured error
(``scripts/families_table.py``; ``examples/check_equivalence.py --model-type TYPE`` certifies one).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ._compat import installed_transformers_version, release
from .families import canonical, lookup

__all__ = [
    "REFUSED",
    "Refusal",
    "RopeIndex",
    "check_not_refused",
    "check_rope_index",
    "find_rope_index",
    "model_type_rope_index",
    "refused_on",
    "rope_index_position_ids",
]


class Refusal(NamedTuple):
    """Why vlm-pack refuses a model type without a record; ``packs_from``: the transformers release (major,
    minor) it packs exactly from (refused only on older ones), None: refused on every release."""

    why: str
    packs_from: tuple[int, int] | None = None


#: Model types without a record that vlm-pack refuses to pack, and why: measured on tiny genuine models of the
#: installed transformers (``scripts/families_table.py``, ``docs/families.md``; ``tests/test_model_types.py``
#: certifies each from the release it packs from). Every other model type without a record takes this module's
#: route; a collator built for one of these raises naming it (:func:`check_not_refused`).
REFUSED: Mapping[str, Refusal] = MappingProxyType({
    # Inkling2ShortConvolution (models/inkling2/modeling_inkling2.py, 5.25): short convolutions inside its attention blocks
    "inkling2": Refusal("its attention blocks hold short convolutions (Inkling2ShortConvolution), a token mixer "
                        "vlm-pack does not isolate: each sample's last tokens would reach the next sample"),
    "inkling2_loop": Refusal("its attention blocks hold short convolutions (Inkling2ShortConvolution, as inkling2), "
                             "a token mixer vlm-pack does not isolate: each sample's last tokens would reach the next "
                             "sample"),
    # modeling_hunyuan_vl.py (5.25) reads the text row of 1 + 4 rows for packed detection, then checks the rows
    # it was given against its 4 RoPE axes and raises; with 4 rows there is no text row to find the samples by
    "hunyuan_vl": Refusal("transformers 5.25's HunYuanVL model refuses position ids with a text row beside its 4 "
                          "xD-RoPE rows (ValueError: Expected 4 multimodal RoPE channels), and without one it finds "
                          "no packed samples"),
    # Glm5NextTextIndexer (models/glm5_next/modeling_glm5_next.py, 5.25): DSA's indexer scores keys over the row
    "glm5_next": Refusal("its indexed-attention layers (Glm5NextTextIndexer) pick their keys over the whole row, "
                         "across packed samples (measured max abs(packed - alone) 4.9 on a tiny text model "
                         "with restarted positions), a token mixer vlm-pack does not split"),
    # MllamaCrossAttentionDecoderLayer: text tokens cross-attend to the images through cross_attention_mask
    "mllama": Refusal("its text layers cross-attend to the images (cross_attention_mask per sample), which the "
                      "packed position ids and transformers' packed mask do not reach; its samples' pixel_values "
                      "[1, images, tiles, ...] do not join into one row either"),
    # the certification row (scripts/families_table.py) on 5.24.0: token_mult_prob_error 5.47, sdpa and eager;
    # 5.25.0: 1.0000003 / 1.0000001
    "molmo2": Refusal("its packed rows are not exact against each sample alone before transformers 5.25 "
                      "(token_mult_prob_error 5.47 on 5.24.0 through transformers' own packed handling)", (5, 25)),
})


def refused_on(model_type: str | None, version: str | None = None) -> str | None:
    """Why vlm-pack refuses ``model_type`` on the installed transformers (or ``version``), or None where it packs
    it (a type with a record, or a type this route packs exactly on that release)."""
    name = canonical(model_type, strict=False)
    if name is None or lookup(name) is not None or name not in REFUSED:
        return None
    why, since = REFUSED[name]
    if since is None:
        return why
    version = installed_transformers_version() if version is None else version
    if version is None or release(version)[:2] >= since:
        return None
    return f"{why} (installed: transformers {version}; upgrade to >= {since[0]}.{since[1]})"


def check_not_refused(model_type: str | None, version: str | None = None) -> None:
    """ValueError naming ``model_type`` and why, when vlm-pack refuses to pack it on the installed transformers
    (or ``version``): :func:`refused_on`."""
    why = refused_on(model_type, version)
    if why is None:
        return
    raise ValueError(
        f"vlm-pack does not pack model type {canonical(model_type, strict=False)!r}: {why}. Train it unpacked (one "
        "sample per row), or see docs/families.md for the model types that pack exactly"
    )


def model_type_rope_index(model_type: str | None) -> str | None:
    """The class in ``model_type``'s transformers modeling module whose ``get_rope_index`` takes ``input_ids``
    (the model computes multimodal RoPE), or None (1-D positions, or not an image-text-to-text type)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type or "")
    if name is None:
        return None
    try:
        module = inspect.getmodule(getattr(importlib.import_module("transformers"), name))
    except Exception:  # a backend it needs is missing: nothing to read
        return None
    for cls_name, cls in vars(module).items():
        fn = getattr(cls, "get_rope_index", None) if isinstance(cls, type) else None
        if fn is not None and _takes_input_ids(fn):
            return cls_name
    return None


def check_rope_index(settings: Any, rope_index: Any) -> None:
    """A collator's ``rope_index=`` where it belongs: a model type without a record whose model computes
    multimodal RoPE needs it (1-D ids would silently lose the images' positions); a family with its own mRoPE
    rule (``Family.mrope``) takes none."""
    if rope_index is not None and settings.mrope:
        raise ValueError(f"rope_index= is for model types without a record; {settings.family!r} has its own mRoPE")
    owner = model_type_rope_index(settings.family) if rope_index is None and settings.unrecorded else None
    if owner is not None:
        raise ValueError(
            f"model type {settings.family!r} computes multimodal RoPE ({owner}.get_rope_index) and vlm-pack has no "
            "record for it: pass PackingCollator(..., rope_index=vlm_pack.model_types.RopeIndex("
            "vlm_pack.model_types.find_rope_index(model))) so that each sample gets its own positions"
        )


def _takes_input_ids(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "input_ids" in params


def find_rope_index(model: Any) -> Any:
    """The module of ``model`` whose ``get_rope_index(input_ids, ...)`` computes its multimodal RoPE (the model
    itself or its ``model`` attribute), or None for a model with 1-D positions. Stubs that only raise (models
    that inherit and disable it take no ``input_ids``) do not count."""
    for owner in (model, getattr(model, "model", None)):
        fn = getattr(owner, "get_rope_index", None) if owner is not None else None
        if fn is not None and _takes_input_ids(fn):
            return owner
    return None


class RopeIndex:
    """The model's own rope-index function, callable per sample and picklable into DataLoader workers.

    In the process that built it, it calls the live module's ``get_rope_index``; unpickled, it rebuilds that
    module's class on the meta device from its config (no weights: the function reads only the config and
    the inputs).
    """

    def __init__(self, owner: torch.nn.Module) -> None:
        self._owner: Any = owner
        self._cls = type(owner)
        self._config = owner.config
        self._params = set(inspect.signature(owner.get_rope_index).parameters)

    def __getstate__(self) -> dict[str, Any]:
        return {"_owner": None, "_cls": self._cls, "_config": self._config, "_params": self._params}

    def _module(self) -> Any:
        if self._owner is None:
            with torch.device("meta"):
                self._owner = self._cls(self._config)
        return self._owner

    def __call__(self, input_ids: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Rope rows ``[k, L]`` of one sample ``input_ids`` ``[L]``; ``inputs``: its other processor outputs
        (``mm_token_type_ids`` ``[L]``, ``image_grid_thw`` ...), passed where the function takes them."""
        kwargs: dict[str, Any] = {}
        for name, value in inputs.items():
            if name in self._params and value is not None:
                kwargs[name] = value[None] if name in _PER_TOKEN and value.dim() == 1 else value
        if "mm_token_type_ids" in self._params and "mm_token_type_ids" not in kwargs:
            kwargs["mm_token_type_ids"] = torch.zeros_like(input_ids)[None]
        if "attention_mask" in self._params:
            kwargs["attention_mask"] = torch.ones_like(input_ids)[None]
        out = self._module().get_rope_index(input_ids[None], **kwargs)
        positions = out[0] if isinstance(out, tuple) else out
        return positions[:, 0].to(torch.int64)


_PER_TOKEN = ("mm_token_type_ids", "token_type_ids")


def rope_index_position_ids(
    rope_index: Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor],
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    per_sample: Sequence[Mapping[str, Any]],
    text_positions: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None = None,
    layout: str = "expanded",
) -> torch.Tensor:
    """Position ids ``[1 + k, R, T]``: the text row ``text_positions`` ``[R, T]`` (per-sample aranges), then the
    ``k`` rope rows of each sample computed alone by ``rope_index`` on its padded span.

    ``input_ids`` ``[R, T]``; ``cu_seqlens_padded`` ``[N + 1]`` offsets into the flattened rows (a row's tail
    belongs to its last sample); ``per_sample[i]``: sample ``i``'s other inputs (its grids ...), in packed order;
    ``mm_token_type_ids`` (packed like ``input_ids``) is cut per sample span (padding is text, type 0).
    """
    if layout != "expanded":
        raise ValueError("rope_index= needs layout='expanded' (the model's rope index numbers expanded tokens)")
    flat = input_ids.reshape(-1)
    types = mm_token_type_ids.reshape(-1) if mm_token_type_ids is not None else None
    cu = cu_seqlens_padded.tolist()
    rows = []
    for i, inputs in enumerate(per_sample):
        start, end = int(cu[i]), int(cu[i + 1])
        own = dict(inputs) if types is None else {**inputs, "mm_token_type_ids": types[start:end]}
        rows.append(rope_index(flat[start:end], own))
    rope = torch.cat(rows, dim=1)
    if rope.shape[1] != flat.numel():
        raise ValueError(
            f"the samples' rope positions cover {rope.shape[1]} tokens but the rows hold {flat.numel()}: "
            "cu_seqlens_padded must cover every row to its end"
        )
    rope = rope.to(text_positions.device).reshape(-1, *input_ids.shape)
    return torch.cat([text_positions.reshape(1, *input_ids.shape), rope])
