"""Pack processed image-text samples into rows a vision-language model trains on exactly as on each alone.

``PackingCollator(capacity)`` takes a list of processed samples (``process_sample`` output, or an HF
processor's output for one example) and returns a :class:`PackedBatch`. Expanded layout, two rows of
``capacity = 16``, ``pad_to_multiple_of = 4`` (every sample's span a multiple of 4, e.g. ``2 * CP``)::

    sample        0: a0 a1 I I I a2      1: b0 b1 b2 b3 b4 b5 b6      2: c0 c1 I I
    expanded len  6                      7                            4
    padded len    8                      8                            4

    row 0   input_ids   a0 a1 I  I  I  a2 _  _  | b0 b1 b2 b3 b4 b5 b6 _      (_ = pad_token_id)
            labels      -  a1 -  -  -  a2 -  -  | -  b1 b2 b3 b4 b5 b6 -      (- = -100; HF convention,
            position    0  1  2  3  4  5  6  7  | 0  1  2  3  4  5  6  7       unshifted: the model shifts)
    row 1   input_ids   c0 c1 I  I  _  _  _  _     _  _  _  _  _  _  _  _
            position    0  1  2  3  4  5  6  7     8  9  10 11 12 13 14 15

    sample_index        [0, 1, 2]             packed order (rows sorted by first sample, samples by index)
    row_of_sample       [0, 0, 1]
    seq_lens            [6, 7, 4]             real lengths, int32
    cu_seqlens          [0, 6, 13, 17]        cumulative real lengths (Transformer Engine "thd")
    cu_seqlens_padded   [0, 8, 16, 32]        offsets in the flattened R*T buffer: the tail of a row
                                              belongs to the row's last sample, so rows end on boundaries

- **labels**: -100 on each sample's *first* token (so the model's next-token shift never makes the last
  token of one sample predict the first of the next), on image tokens (as the processor set them) and on
  padding.
- **position_ids** restart at 0 in every sample; padding continues its sample's numbering, so the
  packed-sequence detection of transformers (a new sample wherever positions do not step by 1) keeps it
  inside that sample, where causal attention hides it from every real token. Qwen2/2.5/3-VL get 4 rows
  ``[4, R, T]``: the text arange, then the sample's own multimodal RoPE (``positions.py``).
- **vision tensors** are concatenated in packed order (``pixel_values``, ``image_grid_thw``,
  ``image_sizes``, video tensors ...); LLaVA-NeXT's 5-D ``pixel_values`` are zero-padded to the most
  patches (the model slices each image by ``image_sizes``).

Collapsed layout (Megatron style: one placeholder ``P`` per image, the model expands it to
``tokens_per_image[i]`` embeddings): the packs become consecutive segments of ONE row (Megatron's packed
format is "thd" with micro batch 1), each exactly ``T`` tokens long once expanded. Padding is placed in
collapsed space so that every sample's *expanded* span is a multiple of ``pad_to_multiple_of``::

    input_ids (collapsed)       a0 a1 P a2 _ _ | b0 b1 b2 b3 b4 b5 b6 _ | c0 c1 P _ _ _ _ ... _
    cu_seqlens                  [0, 4, 11, 14]        collapsed real lengths
    cu_seqlens_padded           [0, 6, 14, 29]        collapsed offsets
    cu_seqlens_expanded         [0, 6, 13, 17]        what attention must use after expansion
    cu_seqlens_padded_expanded  [0, 8, 16, 32]
    position_ids                expanded space [1, R*T] (or [4, 1, R*T]): what the language model sees

``batch.model_inputs(style)`` gives the keyword arguments of one model call:

- ``"sdpa"`` / ``"eager"``: HF ``input_ids``, ``labels``, ``position_ids``, vision tensors,
  ``use_cache=False`` and NO ``attention_mask`` (transformers then derives the block-diagonal mask from
  the position restarts);
- ``"flash_attention_2"``: the rows flattened to ``[1, R*T]`` plus ``cu_seq_lens_q/k`` (=
  ``cu_seqlens_padded``) and ``max_length_q/k``: the names transformers' flash path reads (never
  ``cu_seqlens``, which would reach the vision tower);
- ``"megatron"``: ``tokens``, per-sample shifted ``labels`` and ``loss_mask``, ``position_ids`` and
  ``packed_seq_params`` (``qkv_format="thd"``, expanded boundaries even in the collapsed layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .positions import is_mrope_family, packed_position_ids
from .remap import remap_cu_seqlens_padded, roll_packed

__all__ = [
    "HF_STYLES",
    "STYLES",
    "PackedBatch",
    "PackedSeqParams",
    "PackingCollator",
    "pad_multiple_for",
]

IGNORE_INDEX = -100
HF_STYLES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
STYLES = (*HF_STYLES, "megatron")

# Vision tensors the HF models take, concatenated along dim 0 in packed order.
_VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
# Per-sample keys the collator consumes itself.
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")
_OWN_KEYS = (*_TOKEN_KEYS, *_VISION_KEYS, "tokens_per_image")
_KEY_NAMES = ("__key__", "key", "id")


def pad_multiple_for(tp: int = 1, cp: int = 1, sequence_parallel: bool = False, fp8: bool = False) -> int:
    """The multiple every packed sample's (expanded) length must be padded to under Megatron parallelism.

    - context parallel (``cp > 1``): each sample is cut into ``2 * cp`` chunks (rank ``r`` holds chunks
      ``r`` and ``2*cp-1-r``), so ``2 * cp``;
    - sequence parallel: every CP chunk is split again over the TP ranks, so ``2 * cp * tp`` (``tp`` alone
      at ``cp == 1``), the rule Megatron Bridge documents and Megatron-LM's multimodal ``get_padding``
      applies. It is a multiple of the looser ``lcm(2*cp, cp*tp)``, so it satisfies both readings;
    - FP8 (Transformer Engine GEMMs need token counts divisible by 16): each rank's local share of the
      sample, ``length / (cp * tp_sp)``, must be a multiple of 16, so ``16 * cp * tp_sp``.

    ``pad_multiple_for(cp=2)`` is 4, ``pad_multiple_for(tp=4, cp=2, sequence_parallel=True)`` is 16; the
    result always passes ``vlm_pack.parallel.check_parallel_config``.
    """
    for name, v in (("tp", tp), ("cp", cp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    sp_tp = tp if sequence_parallel and tp > 1 else 1
    multiple = (2 * cp if cp > 1 else 1) * sp_tp
    if fp8:
        multiple = math.lcm(multiple, 16 * cp * sp_tp)
    return multiple


try:  # pragma: no cover - exercised only where Megatron-Core is installed
    from megatron.core.packed_seq_params import PackedSeqParams  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - the branch taken on this project's CI

    @dataclass
    class PackedSeqParams:  # type: ignore[no-redef]
        """Megatron-Core's ``PackedSeqParams`` fields (used when megatron.core is not installed)."""

        qkv_format: str = "thd"
        cu_seqlens_q: torch.Tensor | None = None
        cu_seqlens_kv: torch.Tensor | None = None
        cu_seqlens_q_padded: torch.Tensor | None = None
        cu_seqlens_kv_padded: torch.Tensor | None = None
        max_seqlen_q: int | None = None
        max_seqlen_kv: int | None = None


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
    - vision tensors in packed order; ``mm_token_type_ids`` shaped like ``input_ids``;
      ``tokens_per_image`` ``[num_images]`` embeddings per image.
    - ``extra``: other per-sample tensors (concatenated along dim 0, or packed like ``input_ids`` when
      they have one entry per token); ``metadata``: non-tensor values (e.g. ``__key__``) in packed order.
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
    image_grid_thw: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    tokens_per_image: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, list[Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ conveniences
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

    def _vision_inputs(self) -> dict[str, torch.Tensor]:
        out = {k: getattr(self, k) for k in _VISION_KEYS if getattr(self, k) is not None}
        # Only the Qwen-VL models read mm_token_type_ids (and require it with image_grid_thw).
        if self.mm_token_type_ids is not None and is_mrope_family(self.family):
            out["mm_token_type_ids"] = self.mm_token_type_ids
        return out

    def model_inputs(self, style: str = "sdpa") -> dict[str, Any]:
        """Keyword arguments for one forward call; ``style`` is one of :data:`STYLES`.

        - ``"sdpa"`` / ``"eager"``: ``[R, T]`` rows, no ``attention_mask``, ``use_cache=False``.
        - ``"flash_attention_2"`` / ``"flash_attention_3"``: rows flattened to ``[1, R*T]`` with
          ``cu_seq_lens_q/k`` and ``max_length_q/k`` from ``cu_seqlens_padded``.
        - ``"megatron"``: ``tokens`` / ``labels`` / ``loss_mask`` ``[1, ...]``, labels already shifted per
          sample (``labels[t]`` is the target of token ``t``), ``position_ids`` and a ``PackedSeqParams``
          with the expanded ``cu_seqlens_q/kv`` (real) and ``cu_seqlens_q/kv_padded``; vision tensors
          under their HF names.
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
        vision = self._vision_inputs()
        if style in ("sdpa", "eager"):
            return {
                "input_ids": self.input_ids,
                "labels": self.labels,
                "position_ids": self.position_ids,
                **vision,
                "use_cache": False,
            }
        flat = self.num_rows * self.row_length
        pos = (
            self.position_ids.reshape(4, 1, flat)
            if self.position_ids.dim() == 3
            else self.position_ids.reshape(1, flat)
        )
        if "mm_token_type_ids" in vision:
            vision["mm_token_type_ids"] = vision["mm_token_type_ids"].reshape(1, flat)
        cu = self.cu_seqlens_padded
        return {
            "input_ids": self.input_ids.reshape(1, flat),
            "labels": self.labels.reshape(1, flat),
            "position_ids": pos,
            **vision,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": self.max_seqlen_padded_expanded,
            "max_length_k": self.max_seqlen_padded_expanded,
            "use_cache": False,
        }

    def _megatron_inputs(self) -> dict[str, Any]:
        tokens = self.input_ids.reshape(1, -1)
        # Shift inside each (padded) sample: the last token of a sample gets -100, never the next one's
        # first token; loss_mask follows.
        labels = roll_packed(self.labels.reshape(1, -1), self.cu_seqlens_padded, shifts=-1, fill=IGNORE_INDEX)
        loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
        if self.layout == "expanded":
            flat = self.num_rows * self.row_length
            pos = (
                self.position_ids.reshape(4, 1, flat)
                if self.position_ids.dim() == 3
                else self.position_ids.reshape(1, flat)
            )
        else:
            pos = self.position_ids
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens_expanded,
            cu_seqlens_kv=self.cu_seqlens_expanded,
            cu_seqlens_q_padded=self.cu_seqlens_padded_expanded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded_expanded,
            max_seqlen_q=self.max_seqlen_padded_expanded,
            max_seqlen_kv=self.max_seqlen_padded_expanded,
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
        if "mm_token_type_ids" in out:
            out["mm_token_type_ids"] = out["mm_token_type_ids"].reshape(1, -1)  # like tokens
        if self.layout == "collapsed" and self.tokens_per_image is not None:
            out["tokens_per_image"] = self.tokens_per_image
        return out

    # ------------------------------------------------------------------ mapping-style access
    def _default_inputs(self) -> dict[str, Any]:
        return self.model_inputs("sdpa" if self.layout == "expanded" else "megatron")

    def keys(self) -> list[str]:
        """The keys of ``model_inputs()`` (sdpa style; megatron style in the collapsed layout).

        So ``model(**batch)`` is ``model(**batch.model_inputs(...))``: ``batch[key]`` gives the model input
        of that name (e.g. the shifted ``labels`` in megatron style) and any other field by name, while
        attribute access (``batch.labels``) always gives the field.
        """
        return list(self._default_inputs().keys())

    def __getitem__(self, key: str) -> Any:
        inputs = self._default_inputs()
        if key in inputs:
            return inputs[key]
        if key in {f.name for f in dataclasses.fields(self)}:
            return getattr(self, key)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        fields = {f.name for f in dataclasses.fields(self)}
        return isinstance(key, str) and (key in fields or key in self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


# ---------------------------------------------------------------------------------------- collator


@dataclass
class _Sample:
    index: int
    name: str  # "sample 3" or "sample 3 (key 'abc')" for error messages
    ids: torch.Tensor  # [L] long, in the collator's layout
    labels: torch.Tensor  # [L] long
    types: torch.Tensor | None  # [L] long mm_token_type_ids
    expanded_len: int
    tokens_per_image: torch.Tensor | None  # [n] long
    vision: dict[str, torch.Tensor]
    token_extra: dict[str, torch.Tensor]
    other_extra: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None) if obj is not None else None
        if value is not None:
            return value
    return None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class PackingCollator:
    """Collate a list of processed samples into a :class:`PackedBatch` (or a model-input dict).

    Args:
        capacity: tokens per row, counted in *expanded* length (what the language model runs on).
        family: model type (``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"``, ``"llava"``, ``"llava_next"``
            ...): Qwen-VL families get 4-row mRoPE position ids. Defaults to ``config.model_type`` or the
            tokenizer's ``vlm_pack_family``; without any, 1-D position ids.
        tokenizer: a tokenizer or processor; ids not given explicitly are read from it.
        config: the model config; ids, ``spatial_merge_size``, ``tokens_per_second`` and LLaVA's
            ``image_seq_length`` not given explicitly are read from it (preferred over the tokenizer).
        image_token_id, video_token_id, vision_start_token_id, pad_token_id, spatial_merge_size,
            tokens_per_second, image_seq_length: explicit values.
        layout: ``"expanded"`` (samples hold one token per vision embedding, as HF processors make them) or
            ``"collapsed"`` (one placeholder per image; each sample gives ``tokens_per_image``, or
            ``image_grid_thw`` (Qwen) / ``image_seq_length`` (LLaVA-1.5) let the collator count).
        pad_to_multiple_of: every sample's expanded span becomes a multiple of this (see
            :func:`pad_multiple_for`); ``capacity`` must be a multiple of it.
        pad_to_capacity: rows are exactly ``capacity`` long (static shapes); else as long as the fullest
            row.
        strategy: how samples are grouped into rows (``vlm_pack.packing.pack``): ``"bfd"`` (default,
            fewest rows), ``"ffd"``, ``"ff"`` (first fit in data order), ``"nf"`` (consecutive samples,
            data order kept across rows). Inside a row samples keep their input order and rows are sorted
            by their first sample, so the layout is reproducible and easy to read.
        max_samples_per_row: optional cap on samples per row.
        return_style: None returns a :class:`PackedBatch`; a style of :data:`STYLES` returns
            ``batch.model_inputs(style)`` (use ``"sdpa"`` etc. as an HF ``Trainer`` ``data_collator``).

    The collator keeps only ints and strings, so it pickles into ``DataLoader`` workers.

    Raises (at call time) ``ValueError`` naming the sample for: a sample longer than ``capacity``, image
    placeholders that do not match the images, a labels/ids length mismatch, an empty sample.
    """

    def __init__(
        self,
        capacity: int,
        *,
        family: str | None = None,
        tokenizer: Any = None,
        config: Any = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        vision_start_token_id: int | None = None,
        pad_token_id: int | None = None,
        spatial_merge_size: int | None = None,
        tokens_per_second: float | None = None,
        image_seq_length: int | None = None,
        layout: str = "expanded",
        pad_to_multiple_of: int = 1,
        pad_to_capacity: bool = True,
        strategy: str = "bfd",
        max_samples_per_row: int | None = None,
        return_style: str | None = None,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
        if capacity % pad_to_multiple_of:
            raise ValueError(
                f"capacity {capacity} is not a multiple of pad_to_multiple_of {pad_to_multiple_of}: use "
                f"capacity={_round_up(capacity, pad_to_multiple_of)} or "
                f"{capacity // pad_to_multiple_of * pad_to_multiple_of}"
            )
        if layout not in ("expanded", "collapsed"):
            raise ValueError(f"layout must be 'expanded' or 'collapsed', got {layout!r}")
        from .packing import STRATEGIES

        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if return_style is not None and return_style not in STYLES:
            raise ValueError(f"return_style must be None or one of {STYLES}, got {return_style!r}")
        if return_style in HF_STYLES and layout != "expanded":
            raise ValueError(
                f"return_style={return_style!r} needs layout='expanded' (HF models expand nothing)"
            )

        tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor carries its tokenizer
        text_cfg = _attr(config, "text_config")
        vision_cfg = _attr(config, "vision_config")
        self.capacity = capacity
        self.family = family or _attr(config, "model_type") or _attr(tok, "vlm_pack_family")
        self.image_token_id = _first_int(
            image_token_id, _attr(config, "image_token_id", "image_token_index"), _attr(tok, "image_token_id")
        )
        self.video_token_id = _first_int(
            video_token_id, _attr(config, "video_token_id"), _attr(tok, "video_token_id")
        )
        self.vision_start_token_id = _first_int(
            vision_start_token_id, _attr(config, "vision_start_token_id"), _attr(tok, "vision_start_token_id")
        )
        self.pad_token_id = _first_int(
            pad_token_id,
            _attr(tok, "pad_token_id"),
            _attr(text_cfg, "pad_token_id"),
            _attr(config, "pad_token_id"),
            0,
        )
        self.spatial_merge_size = _first_int(
            spatial_merge_size,
            _attr(vision_cfg, "spatial_merge_size"),
            _attr(getattr(tokenizer, "image_processor", None), "merge_size"),
            2,
        )
        tps = tokens_per_second if tokens_per_second is not None else _attr(vision_cfg, "tokens_per_second")
        self.tokens_per_second = tps
        self.image_seq_length = _first_int(image_seq_length, _attr(config, "image_seq_length"))
        self.layout = layout
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_capacity = bool(pad_to_capacity)
        self.strategy = strategy
        self.max_samples_per_row = max_samples_per_row
        self.return_style = return_style
        self.mrope = is_mrope_family(self.family)
        if self.family is None and self.vision_start_token_id is not None:
            # <|vision_start|> marks a Qwen-VL vocabulary: 1-D positions would silently disable the packed
            # mask (the model then sees no text row) and, for Qwen3-VL, the image mRoPE.
            raise ValueError(
                "the tokenizer/config has a vision_start_token_id (a Qwen-VL model) but no family: pass "
                "config=model.config or family='qwen2_vl' / 'qwen2_5_vl' / 'qwen3_vl' so that position_ids "
                "get the 4-row multimodal RoPE"
            )

    def __repr__(self) -> str:
        return (
            f"PackingCollator(capacity={self.capacity}, family={self.family!r}, layout={self.layout!r}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of}, strategy={self.strategy!r})"
        )

    # ------------------------------------------------------------------ per sample
    def _normalise(self, index: int, sample: Mapping[str, Any]) -> _Sample:
        if not isinstance(sample, Mapping):
            raise TypeError(f"sample {index}: expected a dict of tensors, got {type(sample).__name__}")
        key = next(
            (sample[k] for k in _KEY_NAMES if k in sample and not isinstance(sample[k], torch.Tensor)), None
        )
        name = f"sample {index}" + (f" (key {key!r})" if key is not None else "")
        if "input_ids" not in sample:
            raise ValueError(f"{name} has no 'input_ids'")
        ids = self._token_tensor(sample["input_ids"], name, "input_ids")
        n_tokens = ids.numel()
        keep = None
        if sample.get("attention_mask") is not None:
            mask = self._token_tensor(sample["attention_mask"], name, "attention_mask")
            if mask.numel() != n_tokens:
                raise ValueError(f"{name}: attention_mask has {mask.numel()} entries, input_ids {n_tokens}")
            if not bool(mask.all()):
                keep = mask.bool()  # a processor's padding: drop it, packing pads by itself
                ids = ids[keep]
        if ids.numel() == 0:
            raise ValueError(f"{name} has no tokens: drop empty samples before collating")

        def token_level(value: Any, what: str, integer: bool = True) -> torch.Tensor:
            t = self._token_tensor(value, name, what, integer=integer)
            if t.numel() != n_tokens:
                raise ValueError(
                    f"{name}: {what} has {t.numel()} entries but input_ids has {n_tokens}: one per token"
                )
            return t[keep] if keep is not None else t

        is_image = (
            ids == self.image_token_id
            if self.image_token_id is not None
            else torch.zeros_like(ids, dtype=torch.bool)
        )
        is_video = (
            ids == self.video_token_id
            if self.video_token_id is not None
            else torch.zeros_like(ids, dtype=torch.bool)
        )
        if sample.get("labels") is not None:
            labels = token_level(sample["labels"], "labels")
        else:
            labels = ids.masked_fill(is_image | is_video, IGNORE_INDEX)
        types = (
            token_level(sample["mm_token_type_ids"], "mm_token_type_ids")
            if sample.get("mm_token_type_ids") is not None
            else None
        )
        if types is None and self.mrope:
            types = is_image.long() + 2 * is_video.long()

        vision: dict[str, torch.Tensor] = {}
        for k in _VISION_KEYS:
            if sample.get(k) is not None:
                v = sample[k]
                vision[k] = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
        if "second_per_grid_ts" in vision:
            vision["second_per_grid_ts"] = vision["second_per_grid_ts"].reshape(-1)
        token_extra: dict[str, torch.Tensor] = {}
        other_extra: dict[str, torch.Tensor] = {}
        metadata: dict[str, Any] = {}
        for k, v in sample.items():
            if k in _OWN_KEYS:
                continue
            if isinstance(v, torch.Tensor):
                if v.dim() in (1, 2) and v.shape[-1] == n_tokens and (v.dim() == 1 or v.shape[0] == 1):
                    token_extra[k] = token_level(v, k, integer=False)  # weights, masks: keep their dtype
                else:
                    other_extra[k] = v
            else:
                metadata[k] = v

        if not self.mrope and ("image_grid_thw" in vision or "video_grid_thw" in vision):
            raise ValueError(
                f"{name} has image_grid_thw/video_grid_thw (a Qwen-VL sample) but the collator's family is "
                f"{self.family!r}: pass config=model.config or family='qwen2_vl' / 'qwen2_5_vl' / 'qwen3_vl'; "
                "without the 4-row mRoPE position_ids the packed samples would attend to each other"
            )
        n_placeholders = int(is_image.sum())
        grid = vision.get("image_grid_thw")
        merge2 = self.spatial_merge_size**2
        tpi = sample.get("tokens_per_image")
        tpi = torch.as_tensor(tpi, dtype=torch.long).reshape(-1) if tpi is not None else None
        n_images = _num_images(vision, tpi)
        if grid is not None:
            grid = grid.reshape(-1, 3)
            vision["image_grid_thw"] = grid
            grid_counts = grid.prod(-1) // merge2
            if tpi is not None and not torch.equal(tpi, grid_counts):
                raise ValueError(
                    f"{name}: tokens_per_image {tpi.tolist()} disagrees with image_grid_thw "
                    f"{grid.tolist()} / merge {self.spatial_merge_size}^2 = {grid_counts.tolist()}"
                )
            tpi = grid_counts
        if tpi is None and n_images and self.image_seq_length is not None and "image_sizes" not in vision:
            tpi = torch.full((n_images,), self.image_seq_length, dtype=torch.long)
        if n_images and self.image_token_id is None:
            raise ValueError(
                f"{name} has images but the collator knows no image_token_id: pass image_token_id=, "
                "tokenizer= or config="
            )
        if n_placeholders and not n_images:
            raise ValueError(
                f"{name}: input_ids hold {n_placeholders} image token(s) but the sample has no images "
                "(pixel_values / image_grid_thw): give the images or remove the placeholders"
            )

        if self.layout == "expanded":
            if n_images and not n_placeholders:
                raise ValueError(
                    f"{name} has {n_images} image(s) but no image token in input_ids: the text needs a "
                    "placeholder per image (expanded by the processor)"
                )
            if tpi is not None and int(tpi.sum()) != n_placeholders:
                raise ValueError(
                    f"{name}: input_ids hold {n_placeholders} image tokens but its {n_images} image(s) make "
                    f"{int(tpi.sum())} ({tpi.tolist()}): the placeholders were expanded for other images, "
                    "another processor setting or another merge size"
                )
            vgrid = vision.get("video_grid_thw")
            if vgrid is not None:
                n_vid = int(is_video.sum()) if self.video_token_id is not None else None
                want = int((vgrid.reshape(-1, 3).prod(-1) // merge2).sum())
                if n_vid is not None and n_vid != want:
                    raise ValueError(
                        f"{name}: input_ids hold {n_vid} video tokens but video_grid_thw makes {want}"
                    )
            expanded_len = ids.numel()
        else:
            if is_video.any() or "video_grid_thw" in vision:
                raise ValueError(
                    f"{name}: the collapsed layout supports images only; use layout='expanded' for videos"
                )
            if n_placeholders != n_images:
                raise ValueError(
                    f"{name}: input_ids hold {n_placeholders} image placeholder(s) but the sample has "
                    f"{n_images} image(s): the collapsed layout needs exactly one placeholder per image"
                )
            if n_images and tpi is None:
                raise ValueError(
                    f"{name}: the collapsed layout needs tokens_per_image (embeddings each placeholder "
                    "becomes); process_sample(..., layout='collapsed') returns it"
                )
            if tpi is not None and bool((tpi < 1).any()):
                raise ValueError(f"{name}: tokens_per_image must be >= 1, got {tpi.tolist()}")
            expanded_len = ids.numel() + (int(tpi.sum()) - n_images if n_images else 0)
        return _Sample(
            index=index,
            name=name,
            ids=ids,
            labels=labels,
            types=types,
            expanded_len=expanded_len,
            tokens_per_image=tpi if n_images else None,
            vision=vision,
            token_extra=token_extra,
            other_extra=other_extra,
            metadata=metadata,
        )

    @staticmethod
    def _token_tensor(value: Any, name: str, what: str, integer: bool = True) -> torch.Tensor:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if t.dim() == 2 and t.shape[0] == 1:  # HF processors return [1, L] for one example
            t = t[0]
        if t.dim() != 1:
            raise ValueError(
                f"{name}: {what} must be [L] or [1, L] (one example), got shape {tuple(t.shape)}; collate "
                "examples one per list entry"
            )
        if not integer:
            return t
        if t.dtype.is_floating_point:
            raise TypeError(f"{name}: {what} must hold integers, got {t.dtype}")
        return t.long()

    # ------------------------------------------------------------------ the batch
    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> PackedBatch | dict[str, Any]:
        batch = self.collate(samples)
        return batch if self.return_style is None else batch.model_inputs(self.return_style)

    def collate(self, samples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        """Pack ``samples`` into as few rows as the strategy finds; never drops a sample."""
        from .packing import pack

        if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
            raise TypeError("PackingCollator takes a list of samples (dicts), one per example")
        if len(samples) == 0:
            raise ValueError("PackingCollator got an empty list of samples")
        items = [self._normalise(i, s) for i, s in enumerate(samples)]
        m = self.pad_to_multiple_of
        padded = [_round_up(s.expanded_len, m) for s in items]
        for s, p in zip(items, padded):
            if p > self.capacity:
                pad_note = f" (padded to {p}, a multiple of {m})" if p != s.expanded_len else ""
                raise ValueError(
                    f"{s.name} is {s.expanded_len} tokens long{pad_note} but a row holds capacity="
                    f"{self.capacity}: raise capacity, lower the images' max_pixels, or split/filter long "
                    "samples before collating (vlm_pack.packing.pack(..., oversized='skip') reports them)"
                )
        result = pack(
            padded, self.capacity, strategy=self.strategy, max_samples_per_bin=self.max_samples_per_row
        )
        rows = sorted((sorted(b) for b in result.bins), key=lambda b: b[0])
        order = [i for row in rows for i in row]
        row_of = [r for r, row in enumerate(rows) for _ in row]
        ordered = [items[i] for i in order]
        n_rows = len(rows)
        used = [sum(padded[i] for i in row) for row in rows]
        T = self.capacity if self.pad_to_capacity else max(used)

        # Expanded spans: the padded length, plus the row's tail for its last sample.
        exp_span = torch.tensor([padded[i] for i in order], dtype=torch.int64)
        last_in_row = torch.cumsum(torch.tensor([len(row) for row in rows], dtype=torch.int64), 0) - 1
        exp_span[last_in_row] += torch.tensor([T - u for u in used], dtype=torch.int64)
        pad_count = exp_span - torch.tensor([s.expanded_len for s in ordered], dtype=torch.int64)
        lens = torch.tensor([s.ids.numel() for s in ordered], dtype=torch.int64)
        span = lens + pad_count  # padding is text, the same count in both layouts

        cu_padded = F.pad(torch.cumsum(span, 0), (1, 0))
        cu_real = F.pad(torch.cumsum(lens, 0), (1, 0))
        total = int(cu_padded[-1])
        # Destination of every real token in the flat buffer: its sample's offset plus its index inside.
        dest = torch.arange(int(cu_real[-1])) + torch.repeat_interleave(cu_padded[:-1] - cu_real[:-1], lens)
        starts = cu_padded[:-1]

        def scatter(parts: list[torch.Tensor], fill: int) -> torch.Tensor:
            cat = torch.cat(parts)
            flat = torch.full((total,), fill, dtype=cat.dtype)
            flat[dest] = cat
            return flat

        flat_ids = scatter([s.ids for s in ordered], self.pad_token_id)
        flat_labels = scatter([s.labels for s in ordered], IGNORE_INDEX)
        flat_labels[starts] = IGNORE_INDEX  # the next-token shift must not cross into this sample
        has_types = any(s.types is not None for s in ordered)
        flat_types = None
        if has_types:
            flat_types = scatter(
                [s.types if s.types is not None else torch.zeros_like(s.ids) for s in ordered], 0
            )

        vision = _concat_vision(ordered)
        tpi_parts = [s.tokens_per_image for s in ordered if s.tokens_per_image is not None]
        tokens_per_image = torch.cat(tpi_parts) if tpi_parts else None

        if self.layout == "expanded":
            shape = (n_rows, T)
            exp_ids, exp_types, cu_padded_exp, cu_exp = flat_ids, flat_types, cu_padded, cu_real
        else:
            shape = (1, total)
            if tokens_per_image is not None:
                cu_exp, cu_padded_exp = remap_cu_seqlens_padded(
                    cu_real, cu_padded, flat_ids, self.image_token_id, tokens_per_image, validate=False
                )
                repeats = torch.ones_like(flat_ids)
                repeats[flat_ids == self.image_token_id] = tokens_per_image
                exp_ids = torch.repeat_interleave(flat_ids, repeats)
                exp_types = torch.repeat_interleave(flat_types, repeats) if flat_types is not None else None
            else:
                cu_exp, cu_padded_exp, exp_ids, exp_types = cu_real, cu_padded, flat_ids, flat_types
        mrope_kwargs: dict[str, Any] = {}
        if self.mrope:
            mrope_kwargs = dict(
                image_grid_thw=vision.get("image_grid_thw"),
                video_grid_thw=vision.get("video_grid_thw"),
                second_per_grid_ts=vision.get("second_per_grid_ts"),
                mm_token_type_ids=exp_types,
                image_token_id=self.image_token_id,
                video_token_id=self.video_token_id,
                # Checks every vision block follows <|vision_start|>, as every Qwen-VL chat template has it.
                vision_start_token_id=self.vision_start_token_id,
                spatial_merge_size=self.spatial_merge_size,
                tokens_per_second=self.tokens_per_second,
            )
        pos_shape = shape if self.layout == "expanded" else (1, exp_ids.numel())
        try:
            position_ids = packed_position_ids(
                exp_ids.reshape(pos_shape),
                cu_padded_exp,
                family=self.family if self.mrope else None,
                **mrope_kwargs,
            )
        except ValueError as e:
            # positions number samples in packed order; name the caller's index instead.
            raise ValueError(_rename_samples(str(e), order)) from None

        token_extra = {}
        for k in {k for s in ordered for k in s.token_extra}:
            dtype = next(s.token_extra[k].dtype for s in ordered if k in s.token_extra)
            token_extra[k] = scatter(
                [s.token_extra.get(k, torch.zeros(s.ids.shape, dtype=dtype)) for s in ordered], 0
            ).reshape(shape)
        other_extra = {}
        for k in {k for s in ordered for k in s.other_extra}:
            parts = [s.other_extra[k] for s in ordered if k in s.other_extra]
            try:
                other_extra[k] = torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts])
            except RuntimeError as e:
                raise ValueError(
                    f"cannot concatenate the per-sample tensors {k!r} along dim 0: {e}"
                ) from None
        metadata = {k: [s.metadata.get(k) for s in ordered] for k in {k for s in ordered for k in s.metadata}}

        seq_lens = lens.to(torch.int32)
        seq_exp = (cu_exp[1:] - cu_exp[:-1]).to(torch.int32)
        span_exp = cu_padded_exp[1:] - cu_padded_exp[:-1]
        return PackedBatch(
            input_ids=flat_ids.reshape(shape),
            labels=flat_labels.reshape(shape),
            position_ids=position_ids,
            seq_lens=seq_lens,
            cu_seqlens=cu_real.to(torch.int32),
            cu_seqlens_padded=cu_padded.to(torch.int32),
            max_seqlen=int(lens.max()),
            sample_index=torch.tensor(order, dtype=torch.int64),
            row_of_sample=torch.tensor(row_of, dtype=torch.int64),
            seq_lens_expanded=seq_exp,
            cu_seqlens_expanded=cu_exp.to(torch.int32),
            cu_seqlens_padded_expanded=cu_padded_exp.to(torch.int32),
            max_seqlen_expanded=int(seq_exp.max()),
            max_seqlen_padded_expanded=int(span_exp.max()),
            num_rows=n_rows,
            row_length=T,
            layout=self.layout,
            family=self.family,
            pad_to_multiple_of=m,
            mm_token_type_ids=flat_types.reshape(shape) if flat_types is not None else None,
            tokens_per_image=tokens_per_image,
            extra={**token_extra, **other_extra},
            metadata=metadata,
            **vision,
        )


def _first_int(*values: Any) -> int | None:
    for v in values:
        if v is not None:
            return int(v)
    return None


def _num_images(vision: dict[str, torch.Tensor], tpi: torch.Tensor | None) -> int:
    if "image_grid_thw" in vision:
        return int(vision["image_grid_thw"].reshape(-1, 3).shape[0])
    if "image_sizes" in vision:
        return int(vision["image_sizes"].reshape(-1, 2).shape[0])
    if tpi is not None:
        return int(tpi.numel())
    pv = vision.get("pixel_values")
    if pv is not None:
        # LLaVA-1.5: [n, C, H, W]; a single [C, H, W] image is one.
        return int(pv.shape[0]) if pv.dim() == 4 else 1
    return 0


def _cat_for_worker(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, 0)``; inside a DataLoader worker, straight into shared memory.

    The DataLoader moves a worker's batch to the main process through shared memory: concatenating into
    it directly (as ``default_collate`` does) saves a second copy of ``pixel_values``, the largest tensor
    of a batch.
    """
    if torch.utils.data.get_worker_info() is None or parts[0].device.type != "cpu":
        return torch.cat(parts, 0)
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    numel = math.prod(shape)
    storage = parts[0]._typed_storage()._new_shared(numel, device=parts[0].device)
    out = parts[0].new(storage).resize_(*shape)
    return torch.cat(parts, 0, out=out)


def _concat_vision(ordered: list[_Sample]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k in _VISION_KEYS:
        parts = [s.vision[k] for s in ordered if k in s.vision]
        if not parts:
            continue
        if k == "pixel_values" and parts[0].dim() == 3 and all(p.dim() == 3 for p in parts):
            parts = [p[None] for p in parts]  # single [C, H, W] images
        if k == "pixel_values" and any(p.dim() == 5 for p in parts):
            # LLaVA-NeXT: [n, patches, C, H, W]; pad every image to the most patches (image_sizes slices).
            most = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        try:
            out[k] = _cat_for_worker(parts)
        except RuntimeError as e:
            raise ValueError(f"cannot concatenate the samples' {k!r} along dim 0: {e}") from None
    return out


def _rename_samples(message: str, order: list[int]) -> str:
    import re

    return re.sub(r"sample (\d+)", lambda mt: f"sample {order[int(mt.group(1))]}", message)
