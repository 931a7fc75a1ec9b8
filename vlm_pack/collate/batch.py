"""What a packed batch carries: ``PackedBatch``, and the model inputs it gives in each attention style.

``PackingCollator`` (``collate.py``) builds it; the layouts are drawn there. Besides the packed rows and
the sample boundaries, a batch tells which samples it holds and in what order::

    batch.sample_index        [N] input index of each packed sample, in packed order
    batch.row_of_sample       [N] the row it sits in
    batch.sample_keys         [N] its key (``__key__``, ``key`` or ``id`` of the sample), or None
    batch.metadata            every non-tensor field of the samples, by name, in packed order

``batch.model_inputs(style)`` gives the keyword arguments of one model call:

- ``"sdpa"`` / ``"eager"``: HF ``input_ids``, ``labels``, ``position_ids``, vision tensors,
  ``use_cache=False`` and NO ``attention_mask`` (transformers then derives the block-diagonal mask from
  the position restarts), except for Gemma 3: ``token_type_ids`` and a dict of per-layer-type masks
  (``masks.py``), since transformers' own packed mask is wrong in its sliding-window layers;
- ``"flash_attention_2"``: the rows flattened to ``[1, R*T]`` plus ``cu_seq_lens_q/k`` (=
  ``cu_seqlens_padded``) and ``max_length_q/k``: the names transformers' flash path reads (never
  ``cu_seqlens``, which would reach the vision tower);
- ``"megatron"``: ``tokens``, per-sample shifted ``labels`` and ``loss_mask``, ``position_ids`` and
  ``packed_seq_params`` (``qkv_format="thd"``, expanded boundaries even in the collapsed layout).

Families whose text model mixes tokens without attention (the record's ``token_mixers``: Qwen3.5's gated
delta net, LFM2's short conv) always get ``seq_idx`` (``[R, T]`` / ``[1, R*T]`` int32, the sample of each
token) in the HF styles: the boundaries and the marker of a packed row. A mixer isolated by
``isolate_token_mixers`` (``forward/mixers.py``) reads its samples from it; transformers' own layers hand it to their
PyTorch fallback, which ignores it before 5.24 and refuses it from 5.24 on: so the first transformers model call
that receives it isolates that model's mixers first (``packed_calls.guard_packed_calls``, armed here and when any
``PackingCollator`` is built), on every release. Rows without the marker (a collator with no family, for a model
type with no record) are recognised by their position ids restarting inside a row. (``cu_seq_lens_q`` is not
added to the sdpa / eager styles: it would reach a VLM's vision tower through ``**kwargs``.)

``PackedSeqParams`` is Megatron-Core's class, imported only when asked for (the megatron style, or the
name itself); where megatron-core is not installed it is a dataclass with the same fields.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import check_experts_mask_mapping, images_past_window
from ..families import canonical, lookup
from ..forward.masks import TOKENS_KEY, MaskMapping, gemma3_attention_masks, real_tokens
from ..forward.packed_calls import carries_mixer_marker, guard_packed_calls
from .labels import IGNORE_INDEX, roll_packed
from .positions import is_mrope_family
from .vision_inputs import VISION_KEYS

__all__ = [
    "HF_STYLES",
    "STYLES",
    "VISION_KEYS",
    "PackedBatch",
    "PackedSeqParams",  # noqa: F822 - resolved lazily by __getattr__
    "packed_seq_params_class",
]

HF_STYLES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
STYLES = (*HF_STYLES, "megatron")
#: Where a sample's key may be, in order of preference (WebDataset's ``__key__`` first).
SAMPLE_KEY_NAMES = ("__key__", "key", "id")


@dataclass
class _FallbackPackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` fields (used when megatron.core is not installed)."""

    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None


# Pickles and prints as vlm_pack.collate.batch.PackedSeqParams, the name it is reached by.
_FallbackPackedSeqParams.__name__ = _FallbackPackedSeqParams.__qualname__ = "PackedSeqParams"


@functools.cache
def packed_seq_params_class() -> type:
    """Megatron-Core's ``PackedSeqParams`` when importable, else a dataclass with its fields.

    Imported on first use only: ``import vlm_pack.collate.collator`` never loads megatron-core.
    """
    try:
        from megatron.core.packed_seq_params import PackedSeqParams  # type: ignore[import-not-found]
    except ImportError:
        return _FallbackPackedSeqParams
    return PackedSeqParams


def thd_params_kwargs(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``PackedSeqParams`` for packed self-attention (``qkv_format="thd"``).

    ``cu_seqlens`` (S+1,) int32 real sample boundaries, ``cu_seqlens_padded`` (S+1,) int32 the boundaries of
    each sample's padded span (where tokens sit, e.g. under context parallelism); queries and keys share both.
    """
    return dict(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )


def __getattr__(name: str) -> Any:
    # ``from vlm_pack.collate.batch import PackedSeqParams`` resolves (and imports megatron-core) only here.
    if name == "PackedSeqParams":
        return packed_seq_params_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _apply(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _apply(v, fn) for k, v in value.items()}
    return value


@dataclass
class PackedBatch:
    """Packed rows and everything a model needs to keep the samples apart. See the module docstring.

    Shapes (``R`` rows of ``T`` tokens, ``N`` samples; collapsed layout: one row of ``Tc`` collapsed tokens
    holding ``R`` packs of ``T`` expanded tokens each):

    - ``input_ids``, ``labels``: ``[R, T]`` long (collapsed ``[1, Tc]``); ``labels`` unshifted (HF).
    - ``position_ids``: ``[R, T]`` or ``[4, R, T]`` (Qwen-VL); collapsed: expanded space ``[1, R*T]`` /
      ``[4, 1, R*T]``.
    - ``seq_lens`` ``[N]``, ``cu_seqlens`` / ``cu_seqlens_padded`` ``[N + 1]``: int32, in the layout's own
      space; the ``*_expanded`` ones always in expanded space (the same tensors in the expanded layout).
    - ``sample_index`` ``[N]``: the input index of each packed sample; ``row_of_sample`` ``[N]``: its row.
    - vision tensors in packed order, joined as the family's model reads them (``vision_inputs.py``:
      ``pixel_values``, Idefics3's and LFM2-VL's ``pixel_attention_mask``, ``image_sizes``, LFM2-VL's
      ``spatial_shapes``, OneVision's per-sample
      ``batch_num_images`` ...); ``mm_token_type_ids`` shaped like ``input_ids``; ``tokens_per_image``
      ``[num_images]`` embeddings per image (collapsed: ``tokens_per_video_placeholder`` ``[m]`` per video
      placeholder); ``sliding_window``: the text config's (Gemma 3's masks);
      ``two_way_layers``: the layer types whose image tokens attend both ways (Gemma 4: sliding only).
    - ``extra``: other per-sample tensors (concatenated along dim 0, or packed like ``input_ids`` when
      they have one entry per token, e.g. Gemma 3's ``token_type_ids``); ``metadata``: non-tensor values
      (e.g. ``__key__``) in packed order.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    sample_index: torch.Tensor
    row_of_sample: torch.Tensor
    seq_lens_expanded: torch.Tensor
    cu_seqlens_expanded: torch.Tensor
    cu_seqlens_padded_expanded: torch.Tensor
    max_seqlen_expanded: int
    max_seqlen_padded_expanded: int
    num_rows: int
    row_length: int
    layout: str = "expanded"
    family: str | None = None
    pad_to_multiple_of: int = 1
    pixel_values: torch.Tensor | None = None
    pixel_attention_mask: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    spatial_shapes: torch.Tensor | None = None
    batch_num_images: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None
    target_sizes: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    tokens_per_image: torch.Tensor | None = None
    tokens_per_video_placeholder: torch.Tensor | None = None
    sliding_window: int | None = None
    two_way_layers: tuple[str, ...] | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the family picks the vision inputs and masks below: one spelling everywhere ("Gemma-3" is "gemma3")
        self.family = canonical(self.family, strict=False)

    # ------------------------------------------------------------------ conveniences
    @property
    def _two_way_images(self) -> bool:
        """The family's image tokens attend both ways inside each image (Gemma 3): its own packed masks."""
        record = lookup(self.family)
        return record is not None and record.two_way_images

    @property
    def _experts(self) -> bool:
        """The family's router counts tokens in a load-balancing loss that reads a padding mask (Qwen3.5-MoE)."""
        record = lookup(self.family)
        if record is None or not record.experts:
            return False
        check_experts_mask_mapping(record.name)
        return True

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def num_real_tokens(self) -> int:
        """Real (expanded) tokens: what the language model runs on, padding excluded."""
        return int(self.seq_lens_expanded.sum())

    @property
    def num_label_tokens(self) -> int:
        """Tokens that carry a loss (labels != -100): the denominator of a per-token loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    def real_tokens(self) -> torch.Tensor:
        """``[R, T]`` int64, 1 on real tokens and 0 on padding (expanded layout): what router statistics and
        an MoE auxiliary loss must count (``vlm_pack.forward.routers``), where the rows carry no 2-D mask."""
        return real_tokens(
            self.cu_seqlens_expanded, self.cu_seqlens_padded_expanded, self.num_rows, self.row_length
        )

    def _apply(self, fn: Any) -> PackedBatch:
        changes = {
            f.name: _apply(getattr(self, f.name), fn)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), (torch.Tensor, dict))
        }
        return dataclasses.replace(self, **changes)

    def to(self, device: Any, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """A copy in pinned memory (``DataLoader(pin_memory=True)`` calls this)."""
        return self._apply(lambda t: t.pin_memory())

    def _flat_positions(self) -> torch.Tensor:
        """``position_ids`` of the rows flattened into one: ``[1, R*T]`` or ``[4, 1, R*T]``."""
        flat = self.num_rows * self.row_length
        if self.position_ids.dim() == 3:  # 4 rows (Qwen-VL); 1 + k rows from a model's own rope index
            return self.position_ids.reshape(self.position_ids.shape[0], 1, flat)
        return self.position_ids.reshape(1, flat)

    def _vision_inputs(self) -> dict[str, torch.Tensor]:
        out = {k: getattr(self, k) for k in VISION_KEYS if getattr(self, k) is not None}
        # Only the Qwen-VL / GLM-4.1V models read mm_token_type_ids (and require it with image_grid_thw).
        if self.mm_token_type_ids is not None and is_mrope_family(self.family):
            out["mm_token_type_ids"] = self.mm_token_type_ids
        # Gemma 3 reads token_type_ids (its images' two-way attention); other models may refuse them.
        if self._two_way_images and "token_type_ids" in self.extra:
            out["token_type_ids"] = self.extra["token_type_ids"]
        if self.family is not None and lookup(self.family) is None:
            # A model type without a record (vlm_pack.model_types): everything its processor gave goes back in.
            if self.mm_token_type_ids is not None:
                out["mm_token_type_ids"] = self.mm_token_type_ids
            out.update(self.extra)
        return out

    def attention_masks(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """The per-layer-type masks of models whose packed rows need one (Gemma 3), else None.

        ``{"full_attention": [R, 1, T, T], "sliding_attention": [R, 1, T, T]}`` (see ``masks.py``): bool
        for ``dtype=None`` (sdpa), additive in ``dtype`` otherwise (eager). Mixture-of-experts families
        (``experts``: Qwen3.5-MoE) get ``{"full_attention": per-sample causal, "linear_attention": None}``, so
        that ``model_inputs`` can pass the 2-D mask of real tokens their router loss reads.
        """
        if not self._two_way_images and not self._experts:
            return None
        # Built once per dtype: batch[name] and `in` go through model_inputs, and the masks are O(T^2).
        cache = self.__dict__.setdefault("_attention_masks", {})
        if dtype not in cache:
            types = self.extra.get("token_type_ids") if self._two_way_images else None
            if types is None and self._two_way_images and self.mm_token_type_ids is not None:
                types = (self.mm_token_type_ids > 0).long()  # Gemma 4: images 1, videos 2
            if types is None:
                types = torch.zeros_like(self.input_ids)  # no two-way images: plain causal per sample
            layers = self.two_way_layers
            if layers is None:  # built without a collator: the family's own
                record = lookup(self.family)
                layers = record.two_way_layers if record is not None else ()
            masks = gemma3_attention_masks(
                types, self.cu_seqlens_padded, self.sliding_window, dtype=dtype, two_way_layers=layers,
                images_past_window=images_past_window(getattr(lookup(self.family), "images_past_window_until", None)),
            )
            if not self._two_way_images:  # mixture of experts: the padding mask is what it needs (real_tokens)
                masks = {"full_attention": masks["full_attention"], "linear_attention": None}
            cache[dtype] = masks
        return cache[dtype]

    def model_inputs(self, style: str = "sdpa", *, mask_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Keyword arguments for one forward call; ``style`` is one of :data:`STYLES`.

        - ``"sdpa"`` / ``"eager"``: ``[R, T]`` rows, no ``attention_mask``, ``use_cache=False``. Gemma 3
          gets ``token_type_ids`` and an ``attention_mask`` dict of its two layer types' masks (bool for
          sdpa, additive in ``mask_dtype`` for eager: use the model's dtype), which keep each image's
          two-way attention inside its sample (transformers' own packed path gets the sliding layers wrong).
          Mixture-of-experts families (Qwen3.5-MoE) get one too, in every style (``full_attention`` and
          ``linear_attention`` None in the flash styles): its ``real_tokens`` is what their load-balancing
          loss reads (``attention_mask.reshape(-1)``), so padding never reaches the router's statistics.
        - ``"flash_attention_2"`` / ``"flash_attention_3"``: rows flattened to ``[1, R*T]`` with
          ``cu_seq_lens_q/k`` and ``max_length_q/k`` from ``cu_seqlens_padded``. (transformers' flash path
          of Gemma 3 attends causally inside images, alone as packed: it cannot express the two-way blocks.)
        - ``"megatron"``: ``tokens`` / ``labels`` / ``loss_mask`` ``[1, ...]``, labels already shifted per
          sample (``labels[t]`` is the target of token ``t``), ``position_ids`` and a ``PackedSeqParams``
          with the expanded ``cu_seqlens_q/kv`` (real) and ``cu_seqlens_q/kv_padded``; vision tensors
          under their HF names.

        Families with ``token_mixers`` always get ``seq_idx`` in the HF styles (the samples' boundaries for
        isolated mixers; a model called with it has its mixers isolated first): see the module docstring.
        """
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        if style == "megatron":
            return self._megatron_inputs()
        if self.layout != "expanded":
            raise ValueError(
                f"model_inputs({style!r}) needs the expanded layout (HF models expect one token per vision "
                "embedding); build the collator with layout='expanded', or use style='megatron'"
            )
        guard_packed_calls()  # this process's models: their first packed call isolates their token mixers
        vision = self._vision_inputs()
        if style in ("sdpa", "eager"):
            out = {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids}
            masks = self.attention_masks(None if style == "sdpa" else mask_dtype)
            if masks is not None:
                tokens = real_tokens(self.cu_seqlens, self.cu_seqlens_padded, self.num_rows, self.row_length)
                out["attention_mask"] = MaskMapping(masks, **{TOKENS_KEY: tokens})
            return {**out, **vision, **self._mixer_inputs(), "use_cache": False}
        flat = self.num_rows * self.row_length
        pos = self._flat_positions()
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in vision:
                vision[name] = vision[name].reshape(1, flat)
        cu = self.cu_seqlens_padded
        if self._experts:  # attention reads cu_seq_lens; the router loss the real tokens
            tokens = real_tokens(self.cu_seqlens, cu, self.num_rows, self.row_length).reshape(1, flat)
            masks = {"full_attention": None, "linear_attention": None, TOKENS_KEY: tokens}
            vision = {**vision, "attention_mask": MaskMapping(masks)}
        return {
            "input_ids": self.input_ids.reshape(1, flat),
            "labels": self.labels.reshape(1, flat),
            "position_ids": pos,
            **vision,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": self.max_seqlen_padded_expanded,
            "max_length_k": self.max_seqlen_padded_expanded,
            **self._mixer_inputs(flat=True),
            "use_cache": False,
        }

    def _mixer_inputs(self, flat: bool = False) -> dict[str, torch.Tensor]:
        """``seq_idx`` [R, T] (``[1, R*T]`` flat) int32 for a family with token mixers (or whose processor
        checkpoints with mixers share: ``Family.mixers_behind_processor``), else {}."""
        if not carries_mixer_marker(self.family):
            return {}
        tokens = torch.arange(self.num_rows * self.row_length, device=self.cu_seqlens_padded.device)
        bounds = self.cu_seqlens_padded[1:].to(tokens.dtype).contiguous()
        seq_idx = torch.searchsorted(bounds, tokens, right=True).to(torch.int32)
        return {"seq_idx": seq_idx.reshape((1, -1) if flat else (self.num_rows, self.row_length))}

    def _megatron_inputs(self) -> dict[str, Any]:
        tokens = self.input_ids.reshape(1, -1)
        # Shift inside each (padded) sample: the last token of a sample gets -100, never the next one's
        # first token; loss_mask follows.
        labels = roll_packed(self.labels.reshape(1, -1), self.cu_seqlens_padded, shifts=-1, fill=IGNORE_INDEX)
        loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
        # The collapsed layout's positions are already one expanded row.
        pos = self._flat_positions() if self.layout == "expanded" else self.position_ids
        params = packed_seq_params_class()(
            **thd_params_kwargs(self.cu_seqlens_expanded, self.cu_seqlens_padded_expanded, self.max_seqlen_padded_expanded)
        )
        out: dict[str, Any] = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": pos,
            "attention_mask": None,
            "packed_seq_params": params,
        }
        out.update(self._vision_inputs())
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in out:
                out[name] = out[name].reshape(1, -1)  # like tokens
        for name in ("tokens_per_image", "tokens_per_video_placeholder"):
            if self.layout == "collapsed" and getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    # ------------------------------------------------------------------ access by name
    @property
    def sample_keys(self) -> list[Any] | None:
        """Each packed sample's key (``__key__``, else ``key`` or ``id`` of the input sample), in packed order.

        ``batch.sample_keys[k]`` belongs to input sample ``batch.sample_index[k]``; None when the samples
        carried no key. Every other non-tensor field of the samples is in ``batch.metadata`` by its name.
        """
        for name in SAMPLE_KEY_NAMES:
            if name in self.metadata:
                return self.metadata[name]
        return None

    def _default_inputs(self) -> dict[str, Any]:
        return self.model_inputs("sdpa" if self.layout == "expanded" else "megatron")

    def model_input_names(self) -> list[str]:
        """The names of ``model_inputs()``: sdpa style, megatron style in the collapsed layout."""
        return list(self._default_inputs())

    def __getitem__(self, name: str) -> Any:
        """``batch[name]``: the default model input of that name (e.g. megatron's shifted ``labels`` in the
        collapsed layout), else the field of that name; attribute access (``batch.labels``) always gives
        the field."""
        inputs = self._default_inputs()
        if name in inputs:
            return inputs[name]
        if name in {f.name for f in dataclasses.fields(self)}:
            return getattr(self, name)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        fields = {f.name for f in dataclasses.fields(self)}
        return isinstance(name, str) and (name in fields or name in self.model_input_names())

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default
